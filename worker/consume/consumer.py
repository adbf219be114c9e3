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

from broker_svc import signals
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.settings import Settings
from broker_svc.topology import DELAY_HOLD_WINDOW_S, EXPIRED_QUEUE
from broker_svc.wire import codec
from broker_svc.wire.task_message import TaskMessage, decode_task, eta_and_expires, safe_repr
from worker.consume.admission import Admission, DedupeWindow
from worker.consume.canvas import Canvas
from worker.consume.eta import EtaScheduler
from worker.consume.job_request import delivery_info, request_context, time_limits
from worker.consume.outcomes import OutcomeHandler
from worker.consume.publish import ReplyPublisher
from worker.consume.rate_limits import RATE_RESERVED_HEADER, RateLimits
from worker.consume.redelivery import Redeliveries, channel_gone
from worker.consume.rejections import Rejections, broker_dead_letter
from worker.consume.settle import ACK, HAND_BACK, LEFT_TO_BROKER, Disposition, Fate, Settler
from worker.consume.slots import FairSlots
from worker.events import EventDispatcher
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
        self._eta = eta
        self._events = events
        self._revoked = revoked
        self._limits = limits
        # Per-task limits set by the ``time_limit`` command: (hard, soft).
        self.time_limits: dict[str, tuple[float | None, float | None]] = {}
        board = pool.feeding.running if pool.feeding is not None else None
        self._state = WorkerState(hostname, pool.running, board)
        # Signals sent by ``revoke(terminate=True)``, for the task-revoked event.
        self._signums: dict[str, int] = {}
        self.received = 0
        self._replies = replies
        self._metrics = metrics  # --metrics-port; None: nothing counted
        self._outcomes = OutcomeHandler(
            app=app, replies=replies, eta=eta, events=events, delivery_limit=settings.delivery_limit,
            namespace=namespace,
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
        # Deliveries waiting for a child: the handler task → its delivery.
        self._reserved: dict[asyncio.Task[Any], aio_pika.abc.AbstractIncomingMessage] = {}
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
        """Finished jobs per task name (inspect ``stats``: ``total``)."""
        return dict(self._outcomes.totals)

    @property
    def unknown_tasks(self) -> dict[str, int]:
        """Deliveries of tasks this app does not register, per name (inspect ``stats``)."""
        return dict(self._rejections.unknown)

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
        stale = [task for task, message in self._reserved.items() if channel_gone(message)]
        for task in stale:
            task.cancel()
        return len(stale)

    async def stop(self, *, timeout_s: float) -> None:
        """Hand back reserved deliveries and wait up to ``timeout_s`` for running ones."""
        self._stopping = True
        for task in list(self._reserved):
            task.cancel()
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
            return HAND_BACK
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
        turned_away = await self._admission.admit(message, request)
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
        tracked = Tracked(request, delivery)
        if request.eta is not None and (parked := await self._until_due(tracked, request.eta)) is not None:
            return parked  # parked in a delay queue until nearly due
        if (parked := await self._rate_limited(message, request)) is not None:
            return parked  # parked until its turn under the task's rate limit
        self.received += 1
        if self._metrics is not None:
            self._metrics.received(request.task, queue)
        if signals.task_received.has_receivers:
            signals.task_received.send(sender=self, request=request)
        # Task events are off unless asked for (-E): check before building one, as every task
        # would pay for the reprs and a coroutine otherwise.
        if self._events.task_events:
            await self._events.send(
                "task-received",
                uuid=request.id,
                name=request.task,
                args=safe_repr(tuple(request.args)),  # Celery shows argsrepr, a tuple's repr
                kwargs=safe_repr(request.kwargs),
                root_id=request.root_id,
                parent_id=request.parent_id,
                retries=request.retries,
                **eta_and_expires(request),
            )
        outcome = await self._run(tracked, message, queue)
        if isinstance(outcome, Disposition):
            return outcome  # handed back (shutdown), revoked while it waited, or joined
        if self._metrics is not None:
            self._metrics.finished(request.task, queue, outcome)
        signum = self._signums.pop(request.id, None)
        return await self._outcomes.finish(message, request, outcome, stopping=self._stopping, signum=signum)

    async def _until_due(self, tracked: Tracked, eta: dt.datetime) -> Disposition | None:
        # Scheduled while it waits in memory for its ETA; parked when that is further off.
        task_id = tracked.request.id
        self._state.scheduled_tasks[task_id] = tracked
        try:
            bucket_ms = await self._eta.defer(eta)
        finally:
            self._state.scheduled_tasks.pop(task_id, None)
        return None if bucket_ms is None else Disposition.republish({}, delay_ms=bucket_ms)

    async def _rate_limited(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage
    ) -> Disposition | None:
        # A token is taken once per task: a copy parked for its turn comes back marked, due.
        if (message.headers or {}).get(RATE_RESERVED_HEADER) is True:
            return None
        delay_s = self._limits.reserve(request.task)
        if delay_s <= 0:
            return None
        if delay_s <= DELAY_HOLD_WINDOW_S:
            await asyncio.sleep(delay_s)  # holds the delivery, never a child
            return None
        # Its turn is later: wait in the broker, not in our prefetch, so other tasks go on.
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay_s)
        log.debug("task_rate_limited", delay_s=round(delay_s, 3))
        return Disposition.republish(
            {"eta": due.isoformat(), RATE_RESERVED_HEADER: True}, delay_ms=self._eta.bucket_for(due)
        )

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
        task = asyncio.current_task()
        assert task is not None
        self._reserved[task] = message
        self._state.reserved_tasks[request.id] = tracked
        try:
            await self._slots.acquire(queue)
        except asyncio.CancelledError:
            # Reserved but never started: the broker gets it back for another worker.
            if channel_gone(message):
                log.info("task_dropped_channel_gone")  # requeued by the broker already
                return LEFT_TO_BROKER
            log.info("task_requeued_on_shutdown")
            return HAND_BACK
        finally:
            self._reserved.pop(task, None)
            self._state.reserved_tasks.pop(request.id, None)
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
