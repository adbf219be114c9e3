"""Tasks for the canvas tests, under names a Celery app registers too (tests/interop/celery_app.py)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from broker_svc import App, chain, chord, group

app = App("canvas")


@app.task(name="canvas.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="canvas.mul")
def mul(x: int, y: int) -> int:
    return x * y


@app.task(name="canvas.xsum")
def xsum(numbers: list[int]) -> int:
    return sum(numbers)


@app.task(name="canvas.fail")
def fail(*args: Any) -> None:
    raise ValueError(f"failed with {list(args)}")


@app.task(name="canvas.note")
def note(task_id: str) -> str:
    """An old-style errback: sent as a task with the failed task's id; notes it in ``$CANVAS_NOTES``."""
    with open(os.environ["CANVAS_NOTES"], "a") as notes:
        notes.write(json.dumps(["note", [task_id]]) + "\n")
    return "noted"


@app.task(name="canvas.on_error")
def on_error(request: Any, exc: BaseException, traceback: str) -> None:
    """A new-style errback: called in the failed task's process with its request and exception."""
    with open(os.environ["CANVAS_NOTES"], "a") as notes:
        notes.write(json.dumps(["on_error", [request.id, repr(exc), "Traceback" in traceback]]) + "\n")


@app.task(name="canvas.collect")
def collect(results: list[Any], label: str = "") -> list[Any]:
    """A chord body: notes each run in ``$CANVAS_NOTES`` (so a test can count them) and returns its input."""
    with open(os.environ["CANVAS_NOTES"], "a") as notes:
        notes.write(json.dumps(["collect", [label, results]]) + "\n")
    return results


@app.task(name="canvas.slow_add")
def slow_add(x: int, y: int, seconds: float = 0.5) -> int:
    time.sleep(seconds)
    return x + y


@app.task(name="canvas.spawn")
def spawn(count: int, queue: str) -> list[str]:
    """Sends ``count`` adds from its body (its children, for ``result.children``); returns their ids."""
    return [add.apply_async((i, i), queue=queue).id for i in range(count)]


@app.task(name="canvas.spawn_canvas")
def spawn_canvas(queue: str, label: str) -> dict[str, Any]:
    """Calls a chain, a group and a chord from its body, as Celery's ``chain(...)()`` and
    ``group(...)()``, all on ``queue``; their bodies note ``<label>-chain``, ``-group``, ``-chord``."""
    chained = chain(
        add.s(1, 1).set(queue=queue),
        add.s(2).set(queue=queue),
        collect.s(label=f"{label}-chain").set(queue=queue),
    )()
    grouped = group(collect.s(i, label=f"{label}-group").set(queue=queue) for i in range(3))()
    chorded = chord([add.s(i, i).set(queue=queue) for i in range(3)])(
        collect.s(label=f"{label}-chord").set(queue=queue)
    )
    return {"chain": chained.id, "group": grouped.id, "members": len(grouped.results), "chord": chorded.id}


@app.task(name="canvas.replace_with", bind=True)
def replace_with(self: Any, x: int, kind: str) -> Any:
    """Replaces itself (Celery's ``self.replace``): by a signature (x + 10), a chain ((x + 1) * 3),
    a group ([x, x + 1, x + 2]), or a task that answers its ``replaced_task_nesting``."""
    queue = self.request.delivery_info.get("routing_key")  # the queue this worker consumes
    if kind == "sig":
        return self.replace(add.si(x, 10).set(queue=queue))
    if kind == "chain":
        return self.replace(chain(add.si(x, 1).set(queue=queue), mul.s(3).set(queue=queue)))
    if kind == "group":
        return self.replace(group(add.si(x, i).set(queue=queue) for i in range(3)))
    if kind == "twice":
        return self.replace(replace_with.si(x, "nesting").set(queue=queue))
    return self.replace(nesting.si().set(queue=queue))


@app.task(name="canvas.nesting", bind=True)
def nesting(self: Any) -> int:
    return int(self.request.replaced_task_nesting)


@app.task(name="canvas.grow", bind=True)
def grow(self: Any, x: int, extra: list[int], lazy: bool = False) -> int:
    """A chord header task that adds ``add(x, e)`` for each ``e`` to its chord (Celery's
    ``self.add_to_chord``), sent to the queue it runs on; returns ``x``."""
    queue = self.request.delivery_info.get("routing_key")
    for e in extra:
        added = self.add_to_chord(add.si(x, e).set(queue=queue), lazy=lazy)
        if lazy:
            added.delay()
    return x
