from __future__ import annotations

import pytest

from broker_svc import JobState, State
from broker_svc.errors import (
    ChordError,
    MessageError,
    NotRegistered,
    TaskDeclined,
    TaskError,
    TaskRevokedError,
    TimeLimitExceeded,
)
from broker_svc.results.result import outcome_error, outcome_value
from broker_svc.wire.records.task_state import FINAL_STATES
from broker_svc.wire.results.message import (
    Outcome,
    describe_wire_exception,
    exception_from_wire,
    exception_to_wire,
    wire_exception,
)
from broker_svc.wire.results.view import OutcomeView
from broker_svc.wire.task.states import READY_STATES


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


def test_a_time_limit_keeps_celerys_wire_and_reads_in_words():
    # The worker sends Celery's map (a Celery client rebuilds TimeLimitExceeded(2.0) from it) ...
    sent = wire_exception("TimeLimitExceeded", 2.0)
    assert sent == {"exc_type": "TimeLimitExceeded", "exc_message": [2.0], "exc_module": "celery.exceptions"}
    assert exception_to_wire(TimeLimitExceeded(2.0)) == sent
    # ... our client raises the importable type, whose text is for people.
    error = exception_from_wire(sent)
    assert (
        type(error) is TimeLimitExceeded and error.args == (2.0,) and repr(error) == "TimeLimitExceeded(2.0)"
    )
    assert str(error) == "task exceeded its hard time limit of 2.0 s"
    assert describe_wire_exception(sent) == "TimeLimitExceeded: task exceeded its hard time limit of 2.0 s"
    # A Celery worker's result names billiard's module, where Celery's class lives.
    celery_worker = {"exc_type": "TimeLimitExceeded", "exc_message": [1], "exc_module": "billiard.exceptions"}
    assert isinstance(exception_from_wire(celery_worker), TimeLimitExceeded)


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


def _declined(result: object) -> Outcome:
    return Outcome(task_id="d", status="DECLINED", result=result)


def test_a_declined_result_is_ready_and_raises_task_declined_naming_the_key():
    wire = wire_exception("TaskDeclined", "dedup key 'k1' has a run and a waiter", module="broker_svc.errors")
    outcome = _declined(wire)
    assert outcome.ready
    with pytest.raises(TaskDeclined, match="k1") as caught:
        outcome_value(outcome, propagate=True)
    assert type(caught.value) is TaskDeclined and isinstance(caught.value, TaskError)
    assert caught.value.exc_type == "TaskDeclined" and caught.value.exc_module == "broker_svc.errors"
    returned = outcome_value(outcome, propagate=False)
    assert isinstance(returned, TaskDeclined)


def test_the_declined_state_decides_even_if_the_exception_map_is_not_the_gates():
    assert isinstance(outcome_error(_declined("no map")), TaskDeclined)
    assert isinstance(outcome_error(_declined(wire_exception("KeyError", "k"))), TaskDeclined)


def test_a_declined_result_reads_as_ready_but_neither_successful_nor_failed():
    class View(OutcomeView):
        id = "d"

        def _latest(self) -> Outcome | None:
            return _declined(wire_exception("TaskDeclined", "k", module="broker_svc.errors"))

    view = View()
    assert view.state == "DECLINED" and view.ready()
    assert not view.successful() and not view.failed()


def test_declined_is_a_ready_state_and_a_final_job_state():
    assert State.DECLINED == "DECLINED" and State.DECLINED in READY_STATES
    assert JobState.DECLINED == "DECLINED" and JobState.DECLINED in FINAL_STATES


def test_other_clockwork_task_errors_come_back_as_their_own_type():
    error = exception_from_wire(wire_exception("ChordError", "part 2 failed", module="broker_svc.errors"))
    assert isinstance(error, ChordError) and isinstance(error, TaskError)
