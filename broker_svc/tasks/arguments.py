"""The check of sent arguments against a task's function (a task's ``typing`` option).

Below ``broker_svc.tasks.task``, which calls it from ``Task.check_arguments``: it reads a task
through ``CheckedTask``, so it needs no import of ``Task``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CheckedTask", "check_call_arguments"]


class CheckedTask(Protocol):
    """What the check reads of a task (a ``Task``); its class carries the function (``__wrapped__``)."""

    @property
    def name(self) -> str: ...

    @property
    def bind(self) -> bool: ...


def check_call_arguments(task: CheckedTask, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
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


def _call_signature(cls: type) -> inspect.Signature | None:
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


_SIGNATURES: dict[type, inspect.Signature | None] = {}
