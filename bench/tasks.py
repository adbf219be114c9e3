"""Tasks the benchmarks run."""

from __future__ import annotations

from broker_svc import App

app = App("bench")


@app.task(name="bench.tasks.noop")
def noop() -> None:
    return None
