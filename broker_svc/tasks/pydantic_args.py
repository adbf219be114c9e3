"""The ``pydantic=True`` task option: model arguments in, model results out, as Celery 5.5 does.

An argument whose parameter is annotated with a pydantic model arrives as a dict (that is what the
wire carries) and is validated into the model before the body runs; a model the body returns is
dumped to a dict. pydantic is imported only by tasks that ask for this.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

__all__ = ["call_with_models"]


def call_with_models(
    function: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    strict: bool = False,
    context: Mapping[str, Any] | None = None,
    dump_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Call ``function`` with model parameters validated from dicts; dump a model it returns.

    Raises:
        ImportError: pydantic is not installed.
        pydantic.ValidationError: an argument does not validate (the task fails with it).
    """
    from pydantic import BaseModel  # only for tasks that use the option

    signature = inspect.signature(function)
    hints = typing.get_type_hints(function)
    bound = signature.bind(*args, **kwargs)
    for name, value in list(bound.arguments.items()):
        model = hints.get(name)
        if isinstance(model, type) and issubclass(model, BaseModel) and not isinstance(value, model):
            bound.arguments[name] = model.model_validate(value, strict=strict, context=dict(context or {}))
    result = function(*bound.args, **bound.kwargs)
    if inspect.iscoroutine(result):  # an ``async def`` task: its model is dumped once awaited
        return _dumped(result, dump_kwargs)
    return _dump(result, dump_kwargs)


async def _dumped(coroutine: Coroutine[Any, Any, Any], dump_kwargs: Mapping[str, Any] | None) -> Any:
    return _dump(await coroutine, dump_kwargs)


def _dump(result: Any, dump_kwargs: Mapping[str, Any] | None) -> Any:
    from pydantic import BaseModel

    if isinstance(result, BaseModel):
        return result.model_dump(**dict(dump_kwargs or {}))
    return result
