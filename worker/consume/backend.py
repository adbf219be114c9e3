"""``FeedBackend``: a consuming child's writes to a Redis result backend, as a Celery worker makes them.

With ``result_backend="redis://..."`` in the worker's app, every state a task's caller is told
(STARTED with ``track_started``, custom states, RETRY, SUCCESS, FAILURE, REVOKED) is also
stored under ``celery-task-meta-<id>`` and PUBLISHed (``broker_svc/redis_results/writer.py``),
and a chord sent by a client whose backend is Redis (its header tasks carry no ``chord_size``)
is counted in Redis as Celery's workers count it (``broker_svc/redis_results/chords.py``), so
Celery workers and ours join one chord together.

A ready state or a chord part is retried for 20 s, as Celery's Redis backend retries a write;
then ``ResultBackendUnavailable`` is raised: the delivery is handed back and runs again, as when
its rpc reply is not confirmed, so a result is never lost silently (each hand-back counts toward
``delivery_limit``). A non-ready state (STARTED, RETRY, progress) is retried for a second, then
logged, and the task goes on: a later state replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import structlog

from broker_svc.app import App
from broker_svc.canvas.follow_ups import FollowUp, follow_ups, runs_in_process
from broker_svc.errors import MessageError, ResultBackendUnavailable
from broker_svc.redis_results.backend_conf import RedisBackendConf
from broker_svc.redis_results.chords import (
    ChordClaim,
    ChordCounter,
    DependencyFailed,
    header_ids,
    header_values,
)
from broker_svc.redis_results.connection import WRITE_BUDGET_S, open_client
from broker_svc.redis_results.writer import ResultWriter
from broker_svc.wire.codec import reply_type
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.results.meta import extended_fields, result_meta
from broker_svc.wire.task.states import READY_STATES, State
from broker_svc.wire.task.task_message import TaskMessage
from worker.consume.replies import FeedReplies

__all__ = ["FeedBackend"]

log = structlog.get_logger(__name__)

# Header states that fail a chord (Celery's PROPAGATE_STATES).
_PROPAGATE: Final = frozenset({State.FAILURE.value, State.REVOKED.value})
# How long a STARTED, RETRY or progress state is retried before the task goes on without it.
_PASSING_STATE_BUDGET_S: Final = 1.0
# How long a claim is kept while the body is published and confirmed.
_PUBLISH_CLAIM_S: Final = 60

Send = Callable[[list[FollowUp]], None]


class FeedBackend:
    """Stores a child's task states in Redis and counts the Redis chords its tasks end.

    Args:
        app: the app whose tasks run here (its errbacks).
        conf: the app's Redis backend.
        hostname: the worker's node name (``result_extended``'s ``worker``).
        replies: the child's confirmed publisher (a failed chord's body answered on ``rpc://`` too).
    """

    def __init__(self, *, app: App, conf: RedisBackendConf, hostname: str, replies: FeedReplies) -> None:
        self._app = app
        self._conf = conf
        self._hostname = hostname
        self._replies = replies
        self._writer = ResultWriter(open_client(conf.url), conf)
        options = app.conf.get("result_backend_transport_options") or {}
        self._chords = ChordCounter(self._writer, ordered=bool(options.get("result_chord_ordered", True)))
        self.queue: str | None = None  # the delivery's queue, for ``result_extended``

    @classmethod
    def for_app(cls, app: App, *, hostname: str, replies: FeedReplies) -> FeedBackend | None:
        """The child's backend writer when the app's ``result_backend`` is a Redis URL, else None."""
        conf = RedisBackendConf.of(app.conf, app.settings)
        return None if conf is None else cls(app=app, conf=conf, hostname=hostname, replies=replies)

    def store(self, request: TaskMessage, outcome: Outcome) -> None:
        """Store a state of ``request`` (the caller wants its results).

        Raises:
            ResultBackendUnavailable: a ready state was not stored (the delivery must not be acked).
        """
        extended = (
            extended_fields(request, hostname=self._hostname, queue=self.queue)
            if self._conf.extended
            else None
        )
        # A non-ready state is not worth holding the task for: the next one replaces it.
        within_s = WRITE_BUDGET_S if outcome.status in READY_STATES else _PASSING_STATE_BUDGET_S
        try:
            meta = result_meta(
                outcome, group_id=request.group, parent_id=request.parent_id, extended=extended
            )
            try:
                self._writer.store(meta, within_s=within_s)
            except (TypeError, ValueError, OverflowError) as exc:  # as the rpc reply: a FAILURE says why
                if outcome.status not in READY_STATES:  # a progress meta it cannot carry: the task goes on
                    log.warning("result_state_not_stored", state=outcome.status, error=str(exc))
                    return
                why = (
                    f"the result of task {request.task!r} (id {outcome.task_id}) cannot be encoded as "
                    f"{self._conf.serializer}: {exc}"
                )
                log.warning("task_result_not_encodable", error=why)
                error = wire_exception("EncodeError", why)
                failed = Outcome(task_id=outcome.task_id, status=State.FAILURE, result=error)
                self._writer.store(
                    result_meta(failed, group_id=request.group, parent_id=request.parent_id, extended=None)
                )
        except ResultBackendUnavailable as exc:
            if outcome.status in READY_STATES:
                raise
            log.warning("result_state_not_stored", state=outcome.status, error=str(exc))

    def store_alone(self, outcome: Outcome) -> None:
        """Store a final state of a task that is not the one running (a refused chord's body).

        Raises:
            ResultBackendUnavailable: it was not stored (the delivery must not be acked).
        """
        self._writer.store(result_meta(outcome, group_id=None, parent_id=None, extended=None))

    def chord_part(self, request: TaskMessage, state: State, result: Any, *, send: Send) -> None:
        """A header task of a Redis-counted chord ended: count it; the last one sends the body.

        Raises:
            ResultBackendUnavailable: Redis did not count it (the delivery must not be acked).
            BrokerSvcError: the body was not confirmed (its claim is let go; the task runs again).
        """
        group_id, body = request.group, request.embed["chord"]
        assert group_id is not None
        try:
            claim = self._chords.part_return(group_id, request.id, request.group_index, state.value, result)
        except (TypeError, ValueError, OverflowError) as exc:
            error = wire_exception(
                "EncodeError", f"chord part cannot be encoded as {self._conf.serializer}: {exc}"
            )
            claim = self._chords.part_return(
                group_id, request.id, request.group_index, State.FAILURE.value, error
            )
        log.info("chord_part_counted", group_id=group_id, index=request.group_index, state=state.value)
        if claim is None:
            return
        try:
            self._complete(request, body, claim, send)
        except BaseException:
            # The body was not sent (or its failure not wholly told): let the claim go, so this
            # task's next run completes the chord (its part counts once; the count stays whole)
            # instead of waiting for the claim to lapse.
            self._release(claim)
            raise

    def _complete(self, request: TaskMessage, body: Mapping[str, Any], claim: ChordClaim, send: Send) -> None:
        # This worker's part completed the chord and it holds the claim: send the body, or fail it.
        group_id = claim.group_id
        try:
            values = self._header_values(claim)
        except (MessageError, ValueError) as exc:  # Celery's "Join error"
            self._fail_body(request, body, f"Join error: {exc}", send)
            self._chords.drop_size(group_id)
            return
        except DependencyFailed as failed:
            self._fail_body(
                request, body, f"Dependency {failed.task_id} raised {_repr_error(failed.result)}", send
            )
            self._chords.drop_size(group_id)
            return
        if not self._chords.extend(claim, _PUBLISH_CLAIM_S):
            log.warning("chord_claim_lost", group_id=group_id)  # another worker took it over
            return
        send(follow_ups(body, parent=request, partial=(values,)))
        if not self._cleanup(claim):
            log.warning("chord_claim_lost_before_cleanup", group_id=group_id)
        log.info("chord_body_sent", group_id=group_id, size=claim.total)

    def _header_values(self, claim: ChordClaim) -> list[Any]:
        # The client saved the header's result tree when it nests groups (a chain ending in one):
        # the values are read by that tree, each group's as a list, as Celery's workers join it.
        # Otherwise the counted entries are the values, in header order.
        saved = self._chords.saved_header(claim)
        if saved is not None:
            return header_values(saved, self._chords.stored(header_ids(saved)))
        entries = [_entry(raw) for raw in self._chords.results(claim)]
        for task_id, part_state, value in entries:
            if part_state in _PROPAGATE:
                raise DependencyFailed(task_id, value)
        return [value for _id, _state, value in entries]

    def _release(self, claim: ChordClaim) -> None:
        try:
            self._chords.release(claim)
        except ResultBackendUnavailable as exc:  # it lapses by itself within its lifetime
            log.warning("chord_claim_not_released", group_id=claim.group_id, error=str(exc))

    def _cleanup(self, claim: ChordClaim) -> bool:
        try:
            return self._chords.cleanup(claim)
        except ResultBackendUnavailable as exc:  # the body went: its keys expire instead
            log.warning("chord_cleanup_failed", group_id=claim.group_id, error=str(exc))
            return False

    def _fail_body(self, request: TaskMessage, body: Mapping[str, Any], why: str, send: Send) -> None:
        # Celery's chord_error_from_stack: the body's result is a ChordError, its errbacks run.
        log.warning("chord_failed", group_id=request.group, why=why)
        options = body.get("options") or {}
        body_id = options.get("task_id")
        error = wire_exception("ChordError", why)
        if isinstance(body_id, str) and body_id:
            failed = Outcome(task_id=body_id, status=State.FAILURE, result=error)
            self.store_alone(failed)
            reply_to = options.get("reply_to") or request.reply_to
            if reply_to:
                self._replies.result(
                    failed,
                    reply_to=reply_to,
                    correlation_id=body_id,
                    content_type=reply_type(request.content_type),
                )
        errbacks: Sequence[Any] = options.get("link_error") or ()
        for errback in errbacks:
            if not isinstance(errback, Mapping):
                continue
            if runs_in_process(self._app, errback):
                log.warning(
                    "chord_errback_not_run",
                    errback=errback.get("task"),
                    why="takes (request, exc, traceback)",
                )
                continue
            send(follow_ups(errback, parent=request, partial=(body_id,)))


def _entry(raw: Any) -> tuple[str, str, Any]:
    # A header result as Celery stores it: [1, task id, state, result].
    if not isinstance(raw, list | tuple) or len(raw) != 4 or not isinstance(raw[1], str):
        raise ValueError(f"a chord result entry must be [1, id, state, result], got {raw!r:.200}")
    return raw[1], str(raw[2]), raw[3]


def _repr_error(value: Any) -> str:
    # As Celery's message shows the rebuilt exception: ``ValueError('boom')``.
    if isinstance(value, Mapping) and "exc_type" in value:
        message = value.get("exc_message")
        args = message if isinstance(message, list) else [message]
        return f"{value['exc_type']}({', '.join(repr(arg) for arg in args)})"
    return repr(value)
