"""A consuming child's run, once it ended: what its caller, chord and callbacks are told, and the
delivery's disposition (success, ignore, retry, reject, failure).

``worker/consume/handle.py`` runs the task and hands the done frame here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, Final

import structlog

from broker_svc.app import App
from broker_svc.topology import DELAY_HOLD_WINDOW_S, delay_bucket_ms
from broker_svc.wire.event_fields import describe_repr
from broker_svc.wire.results.message import Outcome, describe_wire_exception, wire_exception
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import TaskMessage, safe_repr
from worker.consume.answers import FeedAnswers, Handled
from worker.consume.canvas import FeedCanvas
from worker.consume.records.events import FeedEvents
from worker.ipc import JobStatus, job_status
from worker.rules import canvas_plan
from worker.rules.deliveries import expected_failure
from worker.rules.disposition import ACK, HAND_BACK, Disposition, retry_copy, retry_eta

__all__ = ["FeedOutcomes"]

log = structlog.get_logger(__name__)


class FeedOutcomes:
    """Turns a finished run's done frame into answers and the delivery's disposition.

    Args:
        app: the app whose tasks run here (a task's ``throws``).
        answers: tells the task's caller, chord and watchers.
        canvas: chord parts and the tasks a success sends on.
        events: sends task events.
        terminated: task ids the worker terminated -> the signal (an ``async def`` task cancelled
            under ``--threads`` is answered as terminated).
    """

    def __init__(
        self,
        *,
        app: App,
        answers: FeedAnswers,
        canvas: FeedCanvas,
        events: FeedEvents,
        terminated: Mapping[str, int],
    ) -> None:
        self._app = app
        self._answers = answers
        self._canvas = canvas
        self.events = events
        self._terminated = terminated
        # A success's runtime, logged after its ack: the line then overlaps the broker's next delivery.
        self.succeeded_ms: float | None = None

    def conclude(self, request: TaskMessage, done: dict[str, Any], runtime_ms: float) -> Handled:
        """A run's outcome: to its caller, its chord and its callbacks; the delivery's disposition."""
        if request.id in self._terminated and _terminated_here(done):
            # An async def task the worker terminated under --threads, cancelled in its thread
            # (worker/child/task_loop.py): answered as a terminated task, as when its child dies.
            return self._answers.skip_revoked(request, expired=False), None
        events = self.events
        status = job_status(done["status"])
        if status is JobStatus.SUCCESS:
            self.succeeded_ms = runtime_ms  # logged once acked (``FeedHandler.log_success``)
            canvas = canvas_plan.wants_anything(request)
            planned = canvas_plan.after_success(request, done["value"]) if canvas else []
            # Celery's result.children: what the body sent, then the callbacks and the next step.
            sent = [*(done.get("children") or ()), *(item.message.id for item in planned)]
            children = [[[child, None], None] for child in sent]
            value = done["value"]
            self._answers.reply(
                request, Outcome(task_id=request.id, status=State.SUCCESS, result=value, children=children)
            )
            self._canvas.chord_part(request, State.SUCCESS, value)
            if planned:
                self._canvas.send(planned, why="after_success")
            if events.enabled:
                events.send(
                    "task-succeeded", uuid=request.id, result=safe_repr(value), runtime=runtime_ms / 1000
                )
            return _FINISHED, None
        if status is JobStatus.IGNORED:
            log.info("task_ignored", runtime_ms=runtime_ms)
            return _FINISHED, None
        error = done.get("error") or wire_exception("Exception", "unknown failure", module="builtins")
        if status is JobStatus.RETRY:
            return self._retry(request, done, error)
        if status is JobStatus.REJECTED:
            if isinstance(done.get("value"), dict) and done["value"].get("requeue"):
                log.info("task_rejected_requeued")
                events.send("task-rejected", uuid=request.id, requeue=True)
                return HAND_BACK, None
            log.warning("task_rejected", error=describe_wire_exception(error))
            self._answers.reply(
                request, Outcome(task_id=request.id, status=State.FAILURE, result=error), failed=True
            )
            self._canvas.chord_part(request, State.FAILURE, error)
            rejected = Disposition.dead_letter("rejected", describe_wire_exception(error), finished=True)
            return rejected, self._answers.rejected(request.id)
        task = self._app.tasks.get(request.task)
        if task is not None and expected_failure(task.throws, error):  # part of its contract: no traceback
            log.info("task_failed_expected", runtime_ms=runtime_ms, error=describe_wire_exception(error))
        else:
            log.warning("task_failed", runtime_ms=runtime_ms, error=error, traceback=done.get("traceback"))
        self._answers.failed(request, error, done.get("traceback"))
        if done.get("retries_exhausted"):
            why = f"failed after {request.retries} retries: {describe_wire_exception(error)}"
            return Disposition.dead_letter("max_retries_exceeded", why, ran=True, finished=True), None
        return _FINISHED, None

    def _retry(self, request: TaskMessage, done: dict[str, Any], error: dict[str, Any]) -> Handled:
        # The copy (same id, retries + 1, new eta) is confirmed before the original is acked; only
        # then are the log line and the RETRY state true.
        value = done["value"] if isinstance(done.get("value"), dict) else {}
        when = retry_eta(value)
        eta = when.isoformat()
        left_s = (when - dt.datetime.now(dt.UTC)).total_seconds()
        delay_ms = delay_bucket_ms(left_s, hold_window_s=DELAY_HOLD_WINDOW_S)

        def announce() -> None:
            described = describe_wire_exception(error)
            log.info("task_retried", retries=request.retries + 1, eta=eta, error=described)
            self.events.send(
                "task-retried",
                uuid=request.id,
                exception=describe_repr(error),
                traceback=done.get("traceback") or "",
            )
            self._answers.reply(
                request,
                Outcome(
                    task_id=request.id, status=State.RETRY, result=error, traceback=done.get("traceback")
                ),
            )

        return retry_copy(request, value, eta, delay_ms=delay_ms), announce


# A run that ended in a final outcome: its delivery is simply acked.
_FINISHED: Final = Disposition(ACK.fate, ran=True, finished=True)


def _terminated_here(done: Mapping[str, Any]) -> bool:
    error = done.get("error")
    return (
        done.get("status") == str(JobStatus.FAILURE)
        and isinstance(error, Mapping)
        and error.get("exc_type") == "TaskRevokedError"
    )
