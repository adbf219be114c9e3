"""The consumer: one delivery → validate → a free child → result → ack (or dead-letter)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aio_pika
import aio_pika.abc
import structlog
from structlog.contextvars import bind_contextvars

from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.settings import Settings
from broker_svc.topology import EXPIRED_QUEUE
from broker_svc.wire import codec
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage, decode_task
from worker.consume.admission import Admission, DedupeWindow
from worker.consume.canvas import Canvas
from worker.consume.eta import EtaScheduler
from worker.consume.job_request import delivery_info, past_dedup_deadline, request_context, time_limits
from worker.consume.outcomes import OutcomeHandler
from worker.consume.publish import ReplyPublisher
from worker.consume.rate_limits import RATE_RESERVED_HEADER, RateLimits
from worker.consume.received import announce_received
from worker.consume.redelivery import Redeliveries
from worker.consume.rejections import Rejections, broker_dead_letter
from worker.consume.settle import ACK, HAND_BACK, LEFT_TO_BROKER, Disposition, Fate, Settler
from worker.consume.slots import FairSlots
from worker.consume.states import TaskStates
from worker.consume.waits import Waits
from worker.events import EventDispatcher
from worker.gate.forward import to_gate
from worker.pool.pool import Job, JobOutcome, ProcessPool
from worker.remote.revoked_set import RevokedSet
from worker.state import Tracked, WorkerState

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["RATE_RESERVED_HEADER", "TaskConsumer"]


log = structlog.get_logger(__name__)

# How long a delivery whose handling failed waits for the publishing channel before it is handed back.
_PUBLISHER_REOPEN_WAIT_S = 5.0
# How long a delivery whose handling failed for another reason waits before it is handed back.
_FAILED_HAND_BACK_PAUSE_S = 0.5


class TaskConsumer:
    """Handles deliveries from the worker's task queues.

    A delivery first waits for one of ``concurrency`` slots (so it only ever goes to a free child);
    while it waits it is *reserved* and, on shutdown, handed back to the broker unstarted.
    """

    def __init__(
        self,
        *,
        app: App,
        pool: ProcessPool,
        replies: ReplyPublisher,
        clock: LamportClock,
        settings: Settings,
        hostname: str,
        concurrency: int,
        eta: EtaScheduler,
        events: EventDispatcher,
        revoked: RevokedSet,
        limits: RateLimits,
        default_time_limits: tuple[float | None, float | None] = (None, None),
        dedupe_window_s: float | None = None,
        namespace: str = "celery",
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self._app = app
        self._pool = pool
        self._clock = clock
        self._settings = settings
        self._hostname = hostname
        self._accept = codec.accept_set(settings.accept_content)
        self._slots = FairSlots(concurrency)
        self._default_limits = default_time_limits
        self._events = events
        self._revoked = revoked
        # Per-task limits set by the ``time_limit`` command: (hard, soft).
        self.time_limits: dict[str, tuple[float | None, float | None]] = {}
        board = pool.feeding.running if pool.feeding is not None else None
        self._state = WorkerState(hostname, pool.running, board)
        # Signals sent by ``revoke(terminate=True)``, for the task-revoked event.
        self._signums: dict[str, int] = {}
        self.received = 0
        self._replies = replies
        self._metrics = metrics  # --metrics-port; None: nothing counted
        self._task_states = TaskStates(replies, hostname=hostname, clock=clock, enabled=settings.task_states)
        self._outcomes = OutcomeHandler(
            app=app, replies=replies, eta=eta, events=events, delivery_limit=settings.delivery_limit,
            namespace=namespace, states=self._task_states,
        )  # fmt: skip
        self._admission = Admission(
            outcomes=self._outcomes,
            delivery_limit=settings.delivery_limit,
            dedupe=DedupeWindow(ttl_s=dedupe_window_s) if dedupe_window_s else None,
        )
        # Deliveries settled without a run: refused, unregistered, revoked (worker.consume.rejections).
        self._rejections = Rejections(replies=replies, events=events, outcomes=self._outcomes)
        # The one place a task delivery is acked or handed back (worker.consume.settle).
        self._settler = Settler(replies=replies, eta=eta)
        # ETA, rate limit, a free child: the waits before a run (worker.consume.waits).
        self._waits = Waits(state=self._state, eta=eta, limits=limits, slots=self._slots)
        self._handlers: set[asyncio.Task[Any]] = set()
        self._stopping = False
        # Tasks running and done here, for a redelivered copy of one (worker.consume.redelivery).
        self._redeliveries = Redeliveries()

    @property
    def processed(self) -> int:
        """Jobs that ended (any outcome)."""
        return self._outcomes.processed

    @property
    def totals(self) -> dict[str, int]:
        """Finished jobs per task name (inspect ``stats``: ``total``), consuming children's included."""
        if self._pool.feeding is None:
            return dict(self._outcomes.totals)
        return dict(self._outcomes.totals + self._pool.feeding.totals)

    @property
    def unknown_tasks(self) -> dict[str, int]:
        """Deliveries of tasks this app does not register, per name (inspect ``stats``)."""
        if self._pool.feeding is None:
            return dict(self._rejections.unknown)
        return dict(self._rejections.unknown + self._pool.feeding.unknown)

    @property
    def running_count(self) -> int:
        """Tasks running in children now."""
        return self._state.running_count

    @property
    def slots(self) -> FairSlots:
        """The children as slots: capacity, in use, and deliveries waiting (the autoscaler's input)."""
        return self._slots

    @property
    def state(self) -> WorkerState:
        """What is scheduled, reserved and running here (for the inspect commands)."""
        return self._state

    async def terminate(self, task_id: str, sig: int) -> bool:
        """Signal the child running ``task_id`` (revoke with terminate)."""
        if self._state.running(task_id) is None:
            return await self._pool.terminate(task_id, sig)  # a consuming child's, if any
        self._signums[task_id] = int(sig)
        return await self._pool.terminate(task_id, sig)

    def on_update(self, task_id: str, payload: dict[str, Any]) -> None:
        """Pool callback: a running task reported a state."""
        request = self._state.running(task_id)
        if request is None:
            log.warning("task_update_ignored", task_id=task_id)
            return
        self._outcomes.update(request, payload)

    @property
    def in_flight(self) -> int:
        """Deliveries being handled (reserved or running)."""
        return len(self._handlers)

    def for_queue(self, queue: str) -> Callable[[aio_pika.abc.AbstractIncomingMessage], Awaitable[None]]:
        """The aio-pika consumer callback for one queue."""

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            # aiormq cancels a channel's consumer tasks when the channel closes. The handling of a
            # delivery must outlive that: its child runs on, a redelivery of it waits for its
            # outcome, and what it did is remembered. So it runs in a task of its own.
            await asyncio.shield(asyncio.create_task(deliver(message)))

        async def deliver(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._handlers.add(task)
            try:
                await self._handle(message, queue)
            except Exception:
                # Typically the connection went away mid-publish. Never leave a delivery held:
                # hand it back (it runs again: at-least-once) and keep consuming.
                log.exception("delivery_failed", queue=queue)
                if not self._stopping:
                    # The publishing connection may still be reconnecting while this one is back:
                    # handed back at once, the delivery would come straight back and fail again.
                    # (Stopping, nothing consumes here any more: it goes to another worker.)
                    if self._replies.is_open:
                        # No reconnect to wait for: whatever failed may fail again on the next
                        # delivery of this message. A pause bounds that loop of redeliveries
                        # and tracebacks to a few a second; it is a backoff, not a wait.
                        await asyncio.sleep(_FAILED_HAND_BACK_PAUSE_S)
                    else:
                        await self._replies.until_open(timeout_s=_PUBLISHER_REOPEN_WAIT_S)
                await self._settler.settle(message, queue, HAND_BACK)
            finally:
                if task is not None:
                    self._handlers.discard(task)

        return on_message

    def drop_stale_reserved(self) -> int:
        """Give up the deliveries waiting for a child whose channel is gone; returns how many.

        The broker requeued them when the channel closed and delivers them again: run here as
        well, each would be a duplicate whose ack carries a stale tag.
        """
        return self._waits.drop_stale_reserved()

    async def stop(self, *, timeout_s: float) -> None:
        """Hand back reserved deliveries and wait up to ``timeout_s`` for running ones."""
        self._stopping = True
        self._waits.hand_back_reserved()
        deadline = time.monotonic() + timeout_s
        while self._handlers and time.monotonic() < deadline:
            await asyncio.wait(set(self._handlers), timeout=max(0.0, deadline - time.monotonic()))

    async def _handle(self, message: aio_pika.abc.AbstractIncomingMessage, queue: str) -> None:
        admitted = await self._admit(message, queue)
        if isinstance(admitted, Disposition):
            self._count_dead_letter(queue, admitted)
            await self._settler.settle(message, queue, admitted)
            return
        request = admitted
        try:
            disposition = await self._handle_task(message, queue, request)
            self._count_dead_letter(queue, disposition)
            await self._settler.settle(message, queue, disposition)
            if disposition.finished:
                self._admission.finished(request)
            if disposition.ran and not self._stopping:
                self._redeliveries.remember_done(request.id, message)
        finally:
            self._admission.release(request)

    def _count_dead_letter(self, queue: str, disposition: Disposition) -> None:
        if self._metrics is not None and disposition.fate is Fate.DEAD_LETTER:
            self._metrics.dead_lettered(queue, disposition.reason or "unknown")

    async def _skip_revoked(self, request: TaskMessage, queue: str, *, expired: bool) -> Disposition:
        if self._metrics is not None:
            self._metrics.revoked(request.task, queue)
        return await self._rejections.skip_revoked(request, expired=expired)

    async def _admit(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str
    ) -> TaskMessage | Disposition:
        # The decoded request, admitted to run (pair with ``Admission.release``), or its fate.
        if self._stopping:
            # An ordered queue's delivery stays unacked: closing its channel hands it back and
            # moves the queue to the next consumer in one step (QueueConsumers.close_ordered).
            return LEFT_TO_BROKER if queue in self._settings.ordered_queues else HAND_BACK
        raw_id = (message.headers or {}).get("id")
        # aio-pika runs each delivery in a task of its own, with a copy of the context: what is
        # bound here is seen by this delivery's log lines only and goes with its task, so there is
        # nothing to unbind (``bound_contextvars`` would copy and restore the context twice per task).
        bind_contextvars(queue=queue, task_id=raw_id if isinstance(raw_id, str) else None)
        try:
            request = decode_task(
                message.body,
                message.headers,
                content_type=message.content_type,
                accept=self._accept,
                max_bytes=self._settings.max_body_bytes,
                correlation_id=message.correlation_id,
                reply_to=message.reply_to,
                priority=message.priority,
            )
        except MessageError as exc:
            return await self._rejections.refuse(message, reason=type(exc).__name__, error=str(exc))
        self._clock.adjust(request.clock)
        bind_contextvars(task_name=request.display_name, attempt=request.retries + 1)
        # Delivery accounting (consume.admission): the delivery limit, classic redelivery counts, dedupe.
        ordered = queue in self._settings.ordered_queues
        if ordered and message.redelivered:
            bind_contextvars(ordered_redelivery=True)  # an ordered queue's failover: marked
            log.warning("ordered_redelivery")
        turned_away = await self._admission.admit(message, request, ordered=ordered)
        return request if turned_away is None else turned_away

    async def _handle_task(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> Disposition:
        # The guards, in order: each may decide the delivery's fate; one that passes them all runs.
        if queue == EXPIRED_QUEUE:
            # Dead-lettered by the broker (the operator's policy): answered, never run.
            reason, origin = broker_dead_letter(message.headers)
            if reason == "expired":
                return await self._skip_revoked(request, queue, expired=True)
            return await self._rejections.dropped_by_broker(request, reason=reason, origin=origin)
        if request.task not in self._app.tasks:
            return await self._rejections.unregistered(request)
        if (why := Canvas.refusal(request)) is not None:
            return await self._rejections.cannot_honour(request, why)
        if (
            gated := to_gate(self._app.tasks[request.task], request, message.headers or {}, queue)
        ) is not None:
            return gated  # its own dedup key, but it did not come through its gate
        delivery = delivery_info(message)
        if self._metrics is not None and delivery["redelivered"]:
            self._metrics.redelivered(queue)
        if delivery["delivery_count"] >= 1 and self._redeliveries.done_but_unacked(request.id):
            log.info("task_redelivery_already_done")
            return ACK
        if request.id in self._revoked:
            return await self._skip_revoked(request, queue, expired=False)
        if request.expires is not None and request.expires <= dt.datetime.now(dt.UTC):
            return await self._skip_revoked(request, queue, expired=True)
        if past_dedup_deadline(request):
            return await self._skip_revoked(request, queue, expired=True)  # evicted from its key
        tracked = Tracked(request, delivery)
        if (
            request.eta is not None
            and (parked := await self._waits.until_due(tracked, request.eta)) is not None
        ):
            return parked  # parked in a delay queue until nearly due
        if (parked := await self._waits.rate_limited(message, request)) is not None:
            return parked  # parked until its turn under the task's rate limit
        self.received += 1
        await announce_received(request, queue, sender=self, events=self._events, metrics=self._metrics)
        outcome = await self._run(tracked, message, queue)
        if isinstance(outcome, Disposition):
            return outcome  # handed back (shutdown), revoked while it waited, or joined
        if self._metrics is not None:
            self._metrics.finished(request.task, queue, outcome)
        signum = self._signums.pop(request.id, None)
        return await self._outcomes.finish(message, request, outcome, stopping=self._stopping, signum=signum)

    async def _run(
        self, tracked: Tracked, message: aio_pika.abc.AbstractIncomingMessage, queue: str
    ) -> JobOutcome | Disposition:
        request = tracked.request
        run = self._redeliveries.orphaned_run(request.id)
        if run is not None:
            # Our own delivery of this task came back (its channel closed while it ran, after
            # consumer_timeout or a lost connection): wait for that run rather than start a
            # second one, then settle this copy with its outcome (cut short: hand it back).
            joined = await self._redeliveries.join(run)
            return HAND_BACK if joined is None else joined
        if (unstarted := await self._waits.for_child(tracked, message, queue)) is not None:
            return unstarted  # cancelled while reserved: shutdown, or its channel gone
        try:
            if request.id in self._revoked:  # revoked while it waited for a child
                return await self._skip_revoked(request, queue, expired=False)
            if request.expires is not None and request.expires <= dt.datetime.now(dt.UTC):
                # Expired while it waited for a child (prefetched): Celery checks again here too.
                return await self._skip_revoked(request, queue, expired=True)
            hard, soft = time_limits(
                request,
                self._app.tasks[request.task],
                override=self.time_limits.get(request.task, (None, None)),
                defaults=self._default_limits,
            )
            job = Job(
                task_id=request.id,
                task_name=request.task,
                args=request.args,
                kwargs=request.kwargs,
                request=request_context(request, tracked.delivery, hostname=self._hostname),
                hard_time_limit_s=hard,
                soft_time_limit_s=soft,
            )
            self._state.start(tracked)
            if self._metrics is not None:
                self._metrics.started(request.task, queue)
            if self._events.task_events:
                await self._events.send("task-started", uuid=request.id)
            await self._task_states.record(request, State.STARTED)
            run = self._redeliveries.start(request.id, message)
            try:
                outcome = await self._pool.run(job)
            except BaseException as exc:
                run.abandon(exc)
                raise
            finally:
                self._redeliveries.end(request.id, run)
                self._state.active_tasks.pop(request.id, None)
            run.outcome.set_result(outcome)
            if run.joined:
                log.info("task_settled_by_redelivery")  # the redelivered copy publishes and acks
                return LEFT_TO_BROKER
            return outcome
        finally:
            self._slots.release()
