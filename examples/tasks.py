"""Example tasks: ``python -m worker -A examples.tasks:app``."""

from __future__ import annotations

import time

from broker_svc import App, Settings

# An entry point of its own (workers import it by path), so it reads CLOCKWORK_* from the env.
app = App("examples", settings=Settings.from_env())


@app.task
def add(x: int, y: int) -> int:
    """Add two numbers."""
    return x + y


@app.task
def word_count(text: str) -> dict[str, int]:
    """Count the words of a text."""
    counts: dict[str, int] = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


@app.task
def slow(seconds: float) -> float:
    """Sleep, then return how long it slept."""
    started = time.monotonic()
    time.sleep(seconds)
    return round(time.monotonic() - started, 3)


@app.task
def fail(message: str) -> None:
    """Always raise ValueError(message)."""
    raise ValueError(message)
