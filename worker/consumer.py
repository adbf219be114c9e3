"""The consumer: one delivery → validate → a free child → result → ack (or dead-letter)."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import aio_pika
import aio_pika.abc
import aiormq.abc
import structlog
from structlog.contextvars import bind_contextvars

from broker_svc import codec
from broker_svc.app import App
from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.message import RESENT_HEADER, TaskMessage, decode_task, safe_repr
from broker_svc.outcome import Outcome, wire_exception
from broker_svc.settings import Settings
from broker_svc.states import State
from broker_svc.topology import DELAY_HOLD_WINDOW_S
from worker.deliveries import DedupeWindow, delivery_count
from worker.eta import EtaScheduler
from worker.events import EventDispatcher
from worker.outcomes import OutcomeHandler, reply_type, settle
from worker.pool import Job, JobOutcome, ProcessPool
from worker.ratelimit import RateLimits
from worker.replies import ReplyPublisher
from worker.revoked import RevokedSet
from worker.slots import FairSlots
from worker.state import Tracked, WorkerState

__all__ = ["RATE_RESERVED_HEADER", "TaskConsumer"]

# On a copy parked for its turn under a rate limit: it holds its token already.
RATE_RESERVED_HEADER: Final = "x-clockwork-rate-reserved"

log = structlog.get_logger(__name__)

# How many finished task ids to remember for redeliveries whose ack was lost (~100 bytes each).
_DONE_REMEMBERED = 10_000
# The pause before a delivery whose handling failed is handed back to the broker.
_HAND_BACK_DELAY_S = 0.5


@dataclass(slots=True)
class _Run:
    """A task running in a child: its delivery, and its outcome for a redelivered copy to await."""

    message: aio_pika.abc.AbstractIncomingMessage
    outcome: asyncio.Future[JobOutcome]
    joined: bool = False


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
    ) -> None:
        self._app = app
        self._pool = pool
        self._replies = replies
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
        self._state = WorkerState(hostname, pool.running)
        # Signals sent by ``revoke(terminate=True)``, for the task-revoked event.
        self._signums: dict[str, int] = {}
        self.received = 0
        self._outcomes = OutcomeHandler(
            app=app,
            replies=replies,
            eta=eta,
            events=events,
            delivery_limit=settings.delivery_limit,
            dedupe=DedupeWindow(ttl_s=dedupe_window_s) if dedupe_window_s else None,
        )
        # Deliveries waiting for a child: the handler task → its delivery.
        self._reserved: dict[asyncio.Task[Any], aio_pika.abc.AbstractIncomingMessage] = {}
        self._handlers: set[asyncio.Task[Any]] = set()
        self._stopping = False
        # Tasks running in children now, by id: a redelivered copy of one waits for it.
        self._runs: dict[str, _Run] = {}
        # Tasks done here, oldest first → the channel their ack went out on (None: it could not).
        self._done: dict[str, aiormq.abc.AbstractChannel | None] = {}

    @property
    def processed(self) -> int:
        """Jobs that ended (any outcome)."""
        return self._outcomes.processed

    @property
    def totals(self) -> dict[str, int]:
        """Finished jobs per task name (inspect ``stats``: ``total``)."""
        return dict(self._outcomes.totals)

    @property
    def running_count(self) -> int:
        """Tasks running in children now."""
        return len(self._state.active_tasks)

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
            return False
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
                # The publishing connection may still be reconnecting while this one is back:
                # handed back at once, the delivery would come straight back and fail again.
                await asyncio.sleep(_HAND_BACK_DELAY_S)
                await settle(message.nack(requeue=True))
            finally:
                if task is not None:
                    self._handlers.discard(task)

        return on_message

    def drop_stale_reserved(self) -> int:
        """Give up the deliveries waiting for a child whose channel is gone; returns how many.

        The broker requeued them when the channel closed and delivers them again: run here as
        well, each would be a duplicate whose ack carries a stale tag.
        """
        stale = [task for task, message in self._reserved.items() if _channel_gone(message)]
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
        if self._stopping:
            await settle(message.nack(requeue=True))
            return
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
            await self._refuse(message, queue, reason=type(exc).__name__, error=str(exc))
            return
        self._clock.adjust(request.clock)
        bind_contextvars(task_name=request.display_name, attempt=request.retries + 1)
        # Delivery accounting (worker.deliveries): the delivery limit, classic redelivery counts, dedupe.
        if not await self._outcomes.admit(message, queue, request):
            return
        try:
            await self._handle_task(message, queue, request)
        finally:
            self._outcomes.release(request)

    async def _refuse(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, *, reason: str, error: str
    ) -> None:
        headers = message.headers or {}
        log.error(
            "task_refused",
            reason=reason,
            error=error,
            size=len(message.body),
            content_type=message.content_type,
            header_names=sorted(str(k) for k in headers)[:32],
        )
        task_id = headers.get("id")
        if isinstance(task_id, str) and message.reply_to:
            exc_type = "ContentDisallowed" if reason == "ContentDisallowed" else "InvalidTaskError"
            await self._replies.publish_result(
                Outcome(task_id=task_id, status=State.FAILURE, result=wire_exception(exc_type, error)),
                reply_to=message.reply_to,
                correlation_id=message.correlation_id,
                content_type=reply_type(message.content_type),
            )
        await self._replies.dead_letter(message, queue=queue, reason=reason, error=error)
        if isinstance(task_id, str):
            await self._events.send("task-rejected", uuid=task_id, requeue=False)
        await settle(message.ack())

    async def _revoked_skip(
        self, message: aio_pika.abc.AbstractIncomingMessage, request: TaskMessage, *, expired: bool
    ) -> None:
        # A revoked (or expired) task never runs: REVOKED result, task-revoked event, then the ack.
        reason = "expired" if expired else "revoked"
        log.info("task_revoked_skipped", reason=reason)
        await self._outcomes.reply(request, Outcome(
            task_id=request.id, status=State.REVOKED, result=wire_exception("TaskRevokedError", reason)
        ))  # fmt: skip
        await self._events.send(
            "task-revoked", uuid=request.id, terminated=False, signum=None, expired=expired
        )
        await settle(message.ack())

    async def _handle_task(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> None:
        if request.task not in self._app.tasks:
            log.error("task_unknown", task_name=request.task)
            await self._outcomes.reply(request, Outcome(
                task_id=request.id, status=State.FAILURE, result=wire_exception("NotRegistered", request.task)
            ))  # fmt: skip
            await self._replies.dead_letter(
                message, queue=queue, reason="NotRegistered", error=f"task {request.task!r} is not registered"
            )
            await self._events.send("task-rejected", uuid=request.id, requeue=False)
            await settle(message.ack())
            return
        redelivered = delivery_count(message.headers, redelivered=message.redelivered) >= 1
        if redelivered and self._done_but_unacked(request.id):
            log.info("task_redelivery_already_done")
            await settle(message.ack())
            return
        if request.id in self._revoked:
            await self._revoked_skip(message, request, expired=False)
            return
        if request.expires is not None and request.expires <= dt.datetime.now(dt.UTC):
            await self._revoked_skip(message, request, expired=True)
            return
        tracked = Tracked(request, _delivery_info(message))
        if request.eta is not None:
            self._state.scheduled_tasks[request.id] = tracked
            try:
                if await self._eta.defer(message, queue=queue, eta=request.eta):
                    return  # parked in a delay queue until nearly due (and acked here)
            finally:
                self._state.scheduled_tasks.pop(request.id, None)
        if await self._rate_limited(message, queue, request):
            return  # parked until its turn under the task's rate limit (and acked here)
        self.received += 1
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
                eta=request.eta.isoformat() if request.eta else None,
                expires=request.expires.isoformat() if request.expires else None,
            )
        outcome = await self._run(tracked, message, queue)
        if outcome is None:
            return  # handed back to the broker (shutdown), or revoked while it waited
        signum = self._signums.pop(request.id, None)
        await self._outcomes.finish(message, queue, request, outcome, stopping=self._stopping, signum=signum)
        if not self._stopping:
            self._remember_done(request.id, message)

    def _remember_done(self, task_id: str, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        # Everything a run leads to (result, retry, dead letter) has gone out by now; only the ack
        # may be lost, with its channel. The broker then redelivers the task.
        try:
            self._done[task_id] = message.channel
        except aio_pika.exceptions.ChannelInvalidStateError:
            self._done[task_id] = None
        if len(self._done) > _DONE_REMEMBERED:
            del self._done[next(iter(self._done))]

    def _done_but_unacked(self, task_id: str) -> bool:
        # A redelivery of a task done here on a channel that has closed since: the broker never
        # got that ack (an acked message is not redelivered), so ack this copy, do not run it again.
        if task_id not in self._done:
            return False
        channel = self._done[task_id]
        if channel is not None and not channel.is_closed:
            return False  # acked on a live channel: a second message with the same id, run it
        del self._done[task_id]
        return True

    async def _rate_limited(
        self, message: aio_pika.abc.AbstractIncomingMessage, queue: str, request: TaskMessage
    ) -> bool:
        # A token is taken once per task: a copy parked for its turn comes back marked, due.
        if (message.headers or {}).get(RATE_RESERVED_HEADER) is True:
            return False
        delay_s = self._limits.reserve(request.task)
        if delay_s <= 0:
            return False
        if delay_s <= DELAY_HOLD_WINDOW_S:
            await asyncio.sleep(delay_s)  # holds the delivery, never a child
            return False
        # Its turn is later: wait in the broker, not in our prefetch, so other tasks go on.
        due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay_s)
        headers = {"eta": due.isoformat(), RATE_RESERVED_HEADER: True}
        await self._eta.publish_delayed(message, queue=queue, eta=due, headers=headers)
        await settle(message.ack())
        log.debug("task_rate_limited", delay_s=round(delay_s, 3))
        return True

    async def _run(
        self, tracked: Tracked, message: aio_pika.abc.AbstractIncomingMessage, queue: str
    ) -> JobOutcome | None:
        request = tracked.request
        run = self._runs.get(request.id)
        if run is not None and _channel_gone(run.message):
            # Our own delivery of this task came back (its channel closed while it ran, after
            # consumer_timeout or a lost connection): wait for that run rather than start a
            # second one, then settle this copy with its outcome.
            return await self._join(run, message)
        task = asyncio.current_task()
        assert task is not None
        self._reserved[task] = message
        self._state.reserved_tasks[request.id] = tracked
        try:
            await self._slots.acquire(queue)
        except asyncio.CancelledError:
            # Reserved but never started: the broker gets it back for another worker.
            if _channel_gone(message):
                log.info("task_dropped_channel_gone")  # requeued by the broker already
            else:
                await settle(message.nack(requeue=True))
                log.info("task_requeued_on_shutdown")
            return None
        finally:
            self._reserved.pop(task, None)
            self._state.reserved_tasks.pop(request.id, None)
        try:
            if request.id in self._revoked:  # revoked while it waited for a child
                await self._revoked_skip(message, request, expired=False)
                return None
            hard, soft = self._time_limits(request)
            job = Job(
                task_id=request.id,
                task_name=request.task,
                args=request.args,
                kwargs=request.kwargs,
                request=self._context(request, message),
                hard_time_limit_s=hard,
                soft_time_limit_s=soft,
            )
            self._state.start(tracked)
            if self._events.task_events:
                await self._events.send("task-started", uuid=request.id)
            run = _Run(message, asyncio.get_running_loop().create_future())
            self._runs[request.id] = run
            try:
                outcome = await self._pool.run(job)
            except BaseException as exc:
                if run.joined and not isinstance(exc, asyncio.CancelledError):
                    run.outcome.set_exception(exc)
                else:
                    run.outcome.cancel()
                raise
            finally:
                if self._runs.get(request.id) is run:
                    del self._runs[request.id]
                self._state.active_tasks.pop(request.id, None)
            run.outcome.set_result(outcome)
            if run.joined:
                log.info("task_settled_by_redelivery")  # the redelivered copy publishes and acks
                return None
            return outcome
        finally:
            self._slots.release()

    async def _join(self, run: _Run, message: aio_pika.abc.AbstractIncomingMessage) -> JobOutcome | None:
        run.joined = True
        log.info("task_redelivery_joined_run")
        try:
            return await asyncio.shield(run.outcome)
        except asyncio.CancelledError:
            if not run.outcome.cancelled():
                raise  # this handler itself was cancelled
            # The run was cut short (shutdown): this copy goes back to the broker unstarted.
            await settle(message.nack(requeue=True))
            return None

    def _time_limits(self, request: TaskMessage) -> tuple[float | None, float | None]:
        # The call's limits win, then the task's own, then the worker's defaults (as Celery).
        task = self._app.tasks[request.task]
        hard, soft = request.timelimit
        override_hard, override_soft = self.time_limits.get(request.task, (None, None))
        hard = hard if hard is not None else override_hard
        soft = soft if soft is not None else override_soft
        hard = hard if hard is not None else task.time_limit or self._default_limits[0]
        soft = soft if soft is not None else task.soft_time_limit or self._default_limits[1]
        return hard, soft

    def _context(self, request: TaskMessage, message: aio_pika.abc.AbstractIncomingMessage) -> dict[str, Any]:
        return {
            "id": request.id,
            "retries": request.retries,
            "hostname": self._hostname,
            "root_id": request.root_id,
            "parent_id": request.parent_id,
            "group": request.group,
            "eta": request.eta.isoformat() if request.eta else None,
            "expires": request.expires.isoformat() if request.expires else None,
            "reply_to": request.reply_to,
            "correlation_id": request.correlation_id,
            "origin": request.origin,
            "ignore_result": request.ignore_result,
            "timelimit": list(request.timelimit),
            "delivery_info": _delivery_info(message),
        }


def _delivery_info(message: aio_pika.abc.AbstractIncomingMessage) -> dict[str, Any]:
    # ``redelivered`` also marks a copy the worker made of a redelivery (classic queues) or of a
    # delivery whose child died, and a message our client sent again after a lost confirm: a
    # repeat run is marked either way. ``delivery_count`` is how many earlier deliveries did not
    # finish (worker.deliveries).
    count = delivery_count(message.headers, redelivered=message.redelivered)
    resent = bool(message.headers and message.headers.get(RESENT_HEADER))
    return {
        "exchange": message.exchange,
        "routing_key": message.routing_key,
        "priority": message.priority,
        "redelivered": message.redelivered or count > 0 or resent,
        "delivery_count": count,
    }


def _channel_gone(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    # A delivery belongs to the channel it came on; once that is closed its tag means nothing.
    try:
        return message.channel.is_closed
    except aio_pika.exceptions.ChannelInvalidStateError:
        return True
