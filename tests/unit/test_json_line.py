"""The worker's JSON line renders what structlog's processors and JSONRenderer rendered."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import structlog
from structlog.contextvars import bind_contextvars, clear_contextvars, merge_contextvars

from broker_svc.logging import _JsonLine, _JsonLines


class _Logger:
    name = "worker.consume.handle"


def _stamp(_logger: object, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict["timestamp"] = "2026-12-07T08:00:00.000001Z"
    return event_dict


def _structlog_chain(method: str, event_dict: dict[str, Any]) -> str:
    # configure_logging's processors before the JSON line replaced them.
    logger = _Logger()
    for processor in (
        merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _stamp,
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ):
        event_dict = processor(logger, method, event_dict)  # type: ignore[arg-type,assignment]
    rendered = structlog.processors.JSONRenderer(serializer=_JsonLines())(logger, method, event_dict)
    assert isinstance(rendered, str)
    return rendered


class _Custom:
    def __repr__(self) -> str:
        return "<custom>"


VALUES = [
    "plain",
    'ünïcode \u2603 and "quotes" \\ and \n newline',
    0,
    -17,
    2**70,
    0.125,
    1e300,
    math.inf,
    -math.inf,
    True,
    False,
    None,
    [1, "two", None],
    {"nested": {"a": 1.5}},
    (1, 2),
    _Custom(),
]


@pytest.fixture(autouse=True)
def _clean_context() -> Any:
    clear_contextvars()
    yield
    clear_contextvars()


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_a_line_is_the_same_json_as_structlog_rendered(value: Any) -> None:
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = line(_Logger(), "info", {"event": "task_succeeded", "value": value})
    old = _structlog_chain("info", {"event": "task_succeeded", "value": value})
    assert new == old


def test_a_nan_is_rendered_as_json_dumps_renders_it() -> None:
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = line(_Logger(), "warning", {"event": "x", "value": math.nan})
    assert new == _structlog_chain("warning", {"event": "x", "value": math.nan})


def test_the_bound_context_is_in_the_line_with_the_same_fields() -> None:
    bind_contextvars(queue="celery", task_id="abc", attempt=1)
    bind_contextvars(task_name="bench.tasks.noop")
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = line(_Logger(), "info", {"event": "task_succeeded", "runtime_ms": 0.5})
    old = _structlog_chain("info", {"event": "task_succeeded", "runtime_ms": 0.5})
    assert json.loads(new) == json.loads(old)
    # The bound names come in another order (structlog's walks the context's own); the rest alike.
    bound = {"queue", "task_id", "attempt", "task_name"}
    assert [k for k in json.loads(new) if k not in bound] == [k for k in json.loads(old) if k not in bound]


def test_a_field_given_wins_over_the_bound_one_and_cleared_names_are_gone() -> None:
    bind_contextvars(queue="bound", gone="soon")
    clear_contextvars()
    bind_contextvars(queue="bound")
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = json.loads(line(_Logger(), "info", {"event": "x", "queue": "given"}))
    assert new["queue"] == "given" and "gone" not in new


@pytest.mark.parametrize("method", ["warn", "exception", "error", "debug"])
def test_levels_are_named_as_add_log_level_names_them(method: str) -> None:
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = line(_Logger(), method, {"event": "x"})
    assert new == _structlog_chain(method, {"event": "x"})


def test_an_exception_is_rendered_as_format_exc_info_renders_it() -> None:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        error = exc
    line = _JsonLine(_stamp)  # type: ignore[arg-type]
    new = line(_Logger(), "error", {"event": "x", "exc_info": error})
    assert new == _structlog_chain("error", {"event": "x", "exc_info": error})
    assert "ValueError: boom" in json.loads(new)["exception"]
