"""The task class made from a function (``build_task_class``) and the check of sent arguments
against that function's signature (a task's ``typing`` option).

Imported by ``broker_svc.tasks.task`` (which re-exports ``build_task_class``, as before); ``Task`` is
imported here only when a class is built, so there is no import cycle.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.sending.dedup_keys import task_dedup
from broker_svc.wire.rates import parse_rate

if TYPE_CHECKING:
    from broker_svc.tasks.task import Task

__all__ = ["build_task_class", "check_call_arguments"]


def check_call_arguments(task: Task, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` now if ``task``'s function would not take these arguments.

    Raises:
        TypeError: the arguments do not fit the function's signature (as Celery's ``typing``).
    """
    signature = _call_signature(type(task))
    if signature is None:
        return
    try:
        if task.bind:
            signature.bind(task, *args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task.name}: {exc}") from None


def _call_signature(cls: type[Task]) -> inspect.Signature | None:
    # Worked out once per task class: ``typing`` checks every send against it.
    if cls in _SIGNATURES:
        return _SIGNATURES[cls]
    function = getattr(cls, "__wrapped__", None)
    signature: inspect.Signature | None = None
    if function is not None:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            pass  # a builtin or C function: nothing to check against
    _SIGNATURES[cls] = signature
    return signature


_SIGNATURES: dict[type[Task], inspect.Signature | None] = {}


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
    from broker_svc.tasks.task import Task  # task imports this module

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
