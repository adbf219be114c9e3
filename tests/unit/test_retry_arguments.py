"""``retry(args=..., kwargs=...)``: the next attempt's arguments, as Celery 5.7's ``Task.retry`` makes
them (tests/interop/test_celery_task_api.py runs the same calls on a Celery worker)."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc import App
from broker_svc.tasks.arguments import retry_arguments


def grow(foo: int, bar: int = 0) -> None: ...


def spread(first: int, /, *rest: int, scale: int = 1) -> None: ...


@pytest.mark.parametrize(
    ("called", "given", "expected"),
    [
        # Neither given: the call's own arguments.
        (((1,), {"bar": 2}), (None, None), ([1], {"bar": 2})),
        # Both given: both replaced.
        (((1,), {"bar": 2}), ((5,), {}), ([5], {})),
        # kwargs alone, after positional arguments: a keyword takes its argument's place.
        (((1,), {}), (None, {"foo": 10}), ([10], {})),
        (((1, 2), {}), (None, {"bar": 20}), ([1, 20], {})),
        # kwargs alone, after keyword arguments only: they replace the call's keywords.
        (((), {"foo": 2, "bar": 5}), (None, {"foo": 20}), ([], {"foo": 20})),
        # args alone: the keywords they now fill are dropped, the others kept.
        (((), {"foo": 3, "bar": 4}), ((2,), None), ([2], {"bar": 4})),
        (((), {"foo": 3, "bar": 4}), ((2, 9), None), ([2, 9], {})),
    ],
)
def test_retry_arguments_as_celery_works_them_out(
    called: tuple[tuple[Any, ...], dict[str, Any]], given: tuple[Any, Any], expected: tuple[Any, Any]
):
    assert retry_arguments(grow, *called, *given) == expected


def test_positional_only_and_star_args_keep_their_places():
    # ``first`` is positional-only: a keyword of that name does not replace it (Celery keeps it).
    assert retry_arguments(spread, [1, 2, 3], {}, None, {"scale": 2}) == ([1, 2, 3], {"scale": 2})
    assert retry_arguments(spread, [1, 2, 3], {}, None, {"first": 9}) == ([1, 2, 3], {"first": 9})


def test_a_function_without_a_signature_gets_what_was_given():
    assert retry_arguments(print, [1], {"sep": ","}, None, {"end": ""}) == ([1], {"end": ""})


def test_an_eager_retry_with_kwargs_alone_runs_with_them():
    app = App("retry", broker="amqp://guest:guest@127.0.0.1:5672/%2Fretry")

    @app.task(bind=True, default_retry_delay=0)
    def grows(self: Any, foo: int, bar: int = 0) -> list[Any]:
        if self.request.retries == 0:
            raise self.retry(kwargs={"foo": foo * 10})
        return [foo, bar, list(self.request.args), dict(self.request.kwargs)]

    assert grows.apply((1,)).get() == [10, 0, [10], {}]
    assert grows.apply((), {"foo": 2, "bar": 5}).get() == [20, 0, [], {"foo": 20}]
