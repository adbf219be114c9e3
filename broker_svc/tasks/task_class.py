"""A task's class: made from a function (``build_task_class``, ``@app.task``) or written as one
(``check_task_class``, ``app.register_task``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from broker_svc.sending.dedup_keys import task_dedup
from broker_svc.tasks.task import Task
from broker_svc.wire.task.rates import parse_rate

__all__ = ["build_task_class", "check_task_class"]


def build_task_class(
    app: object, fn: Callable[..., Any], *, name: str, base: type[Task], options: Mapping[str, Any]
) -> type[Task]:
    """Make the task subclass for ``fn`` (Celery's pattern: one class per task).

    ``app`` (the ``App`` registering it) becomes the class's ``app``, as it is.

    Raises:
        TypeError: an unknown task option, a base that is not a ``Task``, or a ``dedup_key`` that
            is neither one of ``fn``'s arguments nor a callable.
        ValueError: a ``rate_limit`` that is not a rate (``"10/s"``, ``"100/m"``, ``"2/h"``, a number),
            or a ``dedup_timeout`` out of range.
    """
    if not (isinstance(base, type) and issubclass(base, Task)):
        raise TypeError(f"base must be a subclass of broker_svc.Task, got {base!r}")
    unknown = set(options) - base.OPTIONS
    if unknown:
        raise TypeError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(base.OPTIONS)}")
    try:
        parse_rate(options.get("rate_limit", base.rate_limit))
    except ValueError as exc:
        raise ValueError(f"task {name!r}: {exc}") from None
    bind = bool(options.get("bind", base.bind))
    dedup_key = options.get("dedup_key", base.dedup_key)
    dedup_timeout = options.get("dedup_timeout", base.dedup_timeout)
    dedup = task_dedup(fn, task_name=name, bind=bind, dedup_key=dedup_key, dedup_timeout=dedup_timeout)
    attrs: dict[str, Any] = {
        **options,
        "_dedup": dedup,
        "name": name,
        "app": app,
        "run": fn if bind else staticmethod(fn),
        "__wrapped__": staticmethod(fn),
        "__doc__": fn.__doc__,
        "__module__": fn.__module__,
        "__qualname__": getattr(fn, "__qualname__", fn.__name__),
    }
    if callable(dedup_key):
        attrs["dedup_key"] = staticmethod(dedup_key)  # a function, not a method of the task
    return type(fn.__name__, (base,), attrs)


def check_task_class(task: Task, app: object) -> Task:
    """Bind a class-based task (``class T(app.Task)``) to ``app`` and check its options; ``task``.

    The checks ``build_task_class`` makes of a decorator's options, made of the class's attributes.

    Raises:
        ValueError: a ``rate_limit`` that is not a rate, or a ``dedup_timeout`` out of range.
        TypeError: a ``dedup_key`` that is neither one of ``run``'s arguments nor a callable.
    """
    cls = type(task)
    try:
        parse_rate(task.rate_limit)
    except ValueError as exc:
        raise ValueError(f"task {task.name!r}: {exc}") from None
    written = inspect.getattr_static(task, "dedup_key")
    if inspect.isfunction(written):
        cls.dedup_key = staticmethod(written)  # a function of the call's arguments, not a method
    cls._dedup = task_dedup(
        task.run, task_name=task.name, bind=False, dedup_key=task.dedup_key, dedup_timeout=task.dedup_timeout
    )
    if getattr(cls, "app", None) is None:
        # A class of plain ``broker_svc.Task``; one of ``app.Task`` keeps the app it was made for.
        cls.app = app  # type: ignore[assignment]  # any TaskApp: T().delay() sends through it
    return task
