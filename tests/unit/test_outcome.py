from __future__ import annotations

import pytest

from broker_svc.errors import MessageError, NotRegistered, TaskError, TaskRevokedError
from broker_svc.wire.result_message import Outcome, exception_from_wire, exception_to_wire, wire_exception


def test_exception_map_has_celerys_shape():
    assert exception_to_wire(ValueError("boom", 3)) == {
        "exc_type": "ValueError",
        "exc_message": ["boom", 3],
        "exc_module": "builtins",
    }


def test_builtin_remote_errors_keep_their_type():
    error = exception_from_wire(
        {"exc_type": "KeyError", "exc_message": ["k"], "exc_module": "builtins"}, "tb"
    )
    assert isinstance(error, KeyError) and isinstance(error, TaskError)
    assert error.exc_type == "KeyError" and error.remote_traceback == "tb"


def test_celery_framework_errors_map_to_ours():
    assert isinstance(exception_from_wire(wire_exception("TaskRevokedError", "expired")), TaskRevokedError)
    assert isinstance(exception_from_wire(wire_exception("NotRegistered", "x.y")), NotRegistered)


def test_unknown_modules_are_never_imported():
    error = exception_from_wire({"exc_type": "Evil", "exc_message": ["x"], "exc_module": "os.system_evil"})
    assert type(error).__name__ == "Evil" and isinstance(error, TaskError)


def test_result_bodies_round_trip_and_validate():
    outcome = Outcome(task_id="a", status="SUCCESS", result=5)
    wire = outcome.to_wire()
    assert wire["date_done"] is not None and wire["children"] == []
    assert Outcome.from_wire(wire).result == 5
    assert Outcome.from_wire({"status": "PROGRESS", "result": {"n": 1}}, correlation_id="b").task_id == "b"
    with pytest.raises(MessageError):
        Outcome.from_wire([1, 2])
    with pytest.raises(MessageError):
        Outcome.from_wire({"task_id": "a", "status": 5})
