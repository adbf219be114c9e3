"""Celery's built-in tasks (``celery.map``, ``celery.starmap``, ...), on every app.

A Celery client (and ours) sends them for ``task.map(it)``, ``task.starmap(it)`` and
``task.chunks(it, n)``. Each runs the named task's body for every item in the same process, as
Celery's do, so the named task must be registered in the worker's app (else ``NotRegistered``).
``inspect registered`` hides them, as Celery's does, unless asked with ``builtins=True``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from broker_svc.errors import NotRegistered

if TYPE_CHECKING:
    from broker_svc.tasks.registry import TaskRegistry
    from broker_svc.tasks.task import Task

__all__ = ["BUILTIN_NAMES", "register_builtins"]

_CHORDS_NOT_BUILT: Final = (
    "{name} is how Celery runs a chord through a result store, which Clockwork does not have: "
    "Clockwork joins chords in the broker. Send the chord from Clockwork's client, or from Celery "
    "with backend='broker_svc.celery_backend:ChordBackend'; nothing of it ran"
)
# Sent by Celery only for a chord through its own result backends: answered with a clear failure.
_CHORD_TASKS: Final = ("celery.chord", "celery.chord_unlock", "celery.group", "celery.chain")


def register_builtins(app: TaskRegistry) -> None:
    """Register Celery's built-in tasks on ``app`` (``App`` does this for every app)."""

    def body_of(task: Mapping[str, Any] | str) -> Task:
        name = task if isinstance(task, str) else str(task.get("task", ""))
        try:
            body = app.tasks[name]
        except KeyError:
            raise NotRegistered(name) from None
        if inspect.iscoroutinefunction(body.run):  # its calls here would be coroutines nobody awaits
            raise TypeError(f"{name} is an async def task: map, starmap and chunks run only plain ones")
        return body

    @app.task(name="celery.map", typing=False)
    def xmap(task: Mapping[str, Any], it: Iterable[Any]) -> list[Any]:
        body = body_of(task)
        return [body(item) for item in it]

    @app.task(name="celery.starmap", typing=False)
    def xstarmap(task: Mapping[str, Any], it: Iterable[Sequence[Any]]) -> list[Any]:
        body = body_of(task)
        return [body(*item) for item in it]

    @app.task(name="celery.chunks", typing=False)
    def chunks(task: Mapping[str, Any], it: Iterable[Sequence[Any]], n: int) -> list[list[Any]]:
        # Celery's sends a group of starmaps from the worker; the values are these, part by part.
        body, items = body_of(task), list(it)
        return [[body(*item) for item in items[i : i + n]] for i in range(0, len(items), max(int(n), 1))]

    @app.task(name="celery.accumulate", typing=False)
    def accumulate(*args: Any, index: int | None = None) -> Any:
        return args[index] if index is not None else args

    @app.task(name="celery.backend_cleanup", typing=False)
    def backend_cleanup() -> None:
        """Results live in each client's reply queue, which expires by itself: nothing to clean."""

    for name in _CHORD_TASKS:
        app.task(name=name, typing=False)(_refuse(name))


def _refuse(name: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(_CHORDS_NOT_BUILT.format(name=name))

    refused.__name__ = refused.__qualname__ = name.replace(".", "_")
    return refused


BUILTIN_NAMES: Final = (
    "celery.map", "celery.starmap", "celery.chunks", "celery.accumulate", "celery.backend_cleanup",
    *_CHORD_TASKS,
)  # fmt: skip
