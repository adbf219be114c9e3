"""A task's arguments: the check of sent ones against its function (``typing``), a retry's.

Below ``broker_svc.tasks.task``, which calls it from ``Task.check_arguments``: it reads a task
through ``CheckedTask``, so it needs no import of ``Task``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["CheckedTask", "check_call_arguments", "retry_arguments"]


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
        if task.bind or not hasattr(type(task), "__wrapped__"):  # a class's ``run`` takes ``self``
            signature.bind(task, *args, **kwargs)
        else:
            signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{task.name}: {exc}") from None


def _call_signature(cls: type) -> inspect.Signature | None:
    # Worked out once per task class: ``typing`` checks every send against it.
    if cls in _SIGNATURES:
        return _SIGNATURES[cls]
    # A decorated function, else a class-based task's ``run`` (the base's takes anything).
    function = getattr(cls, "__wrapped__", None) or getattr(cls, "run", None)
    signature: inspect.Signature | None = None
    if function is not None:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            pass  # a builtin or C function: nothing to check against
    _SIGNATURES[cls] = signature
    return signature


_SIGNATURES: dict[type, inspect.Signature | None] = {}


def retry_arguments(
    run: Callable[..., Any],
    called_args: Sequence[Any],
    called_kwargs: Mapping[str, Any],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
) -> tuple[list[Any], dict[str, Any]]:
    """The arguments of a retry's next attempt, as Celery 5.7's ``Task.retry`` works them out.

    Given arguments replace the call's. When only one of ``args``/``kwargs`` is given, the call's
    other half is kept where it does not clash with the new calling convention (Celery #6494):
    new ``args`` drop the kept keywords they now fill; new ``kwargs`` take the place of a kept
    positional argument of the same name. So ``retry(kwargs={"foo": 1})`` after ``f(2)`` calls
    ``f(1)``, never ``f(2, foo=1)``.

    Args:
        run: the task body as it is called (a bound method for a class-based task).
        called_args: the running call's positional arguments.
        called_kwargs: its keyword arguments.
        args: ``retry(args=...)``, or None.
        kwargs: ``retry(kwargs=...)``, or None.
    """
    new_args = list(called_args) if args is None else list(args)
    new_kwargs = dict(called_kwargs) if kwargs is None else dict(kwargs)
    one_given = (args is None) != (kwargs is None)
    kept_clashes = (args is not None and called_kwargs) or (kwargs is not None and called_args)
    if not (one_given and kept_clashes):
        return new_args, new_kwargs
    try:
        signature = inspect.signature(run)
    except (TypeError, ValueError):
        return new_args, new_kwargs  # nothing to match names with: the sent arguments decide
    parameters = signature.parameters
    if args is not None:
        positional = [p for p in parameters.values() if p.kind in _POSITIONAL]
        for parameter in positional[: len(args)]:
            if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
                new_kwargs.pop(parameter.name, None)
        return new_args, new_kwargs
    # Kept positional values bound to names, so *args and positional-only ones keep their places.
    try:
        bound = signature.bind_partial(*called_args)
    except TypeError:
        return new_args, new_kwargs
    for name in list(new_kwargs):
        if name in bound.arguments and parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            bound.arguments[name] = new_kwargs.pop(name)
    return list(bound.args), {**bound.kwargs, **new_kwargs}


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
