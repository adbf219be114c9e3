"""``inspect scheduled``: the ETA tasks parked in the delay queues, read back from the stream.

A task not yet due waits in one of its queue's delay queues, not in a worker (docs/design.md,
ETA), so nothing in a worker's memory lists it. Each park is a record on the app's scheduled
stream (``broker_svc/wire/records/parked.py``): written by the parking child before its ack, or by our
client as it sends a task straight to a delay queue (a record with no worker's name). Every
worker follows the stream from its start and keeps each task's latest record. It lists the tasks
whose ETA has not passed and whose latest park was its own, or was a client's and falls to it:
of the live workers that consume the task's queue, one lists it (``worker/rules/listers.py``),
by the members stream it also follows. A task parked again by a worker moves to that worker's
list; one that came due leaves every list. Read from the start, the list is the same after a
restart of the worker (under the same node name).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.errors import MessageError
from broker_svc.topology import DEFAULT_NAMESPACE, LEGACY_NAMESPACE, scheduled_stream
from broker_svc.wire.records.parked import Parked
from control.aio.members_feed import AsyncMembersFeed
from worker.events import SW_IDENT
from worker.remote.queue_members import QueueMembership
from worker.rules.listers import lister_of

__all__ = ["ScheduledLog"]

log = structlog.get_logger(__name__)

_PREFETCH: Final = 1000
# A subscription that fails (a stream declared by several workers at once, a refused permission)
# is tried again after these pauses, then every last one.
_RETRY_PAUSES_S: Final = (0.25, 0.5, 1.0, 2.0, 5.0, 30.0)


class ScheduledLog:
    """Each parked task's latest record, from the app's scheduled stream, and who lists it.

    Args:
        hostname: this node: the records it lists are its own, and its share of the clients'.
        namespace: the app namespace, which names the stream (and whose workers share the clients').
        control_namespace: the control namespace, whose members stream tells the live workers.
        task_queues: the task queues this worker consumes now.
    """

    def __init__(
        self,
        *,
        hostname: str,
        namespace: str,
        control_namespace: str = DEFAULT_NAMESPACE,
        task_queues: Callable[[], Collection[str]] = tuple,
    ) -> None:
        self._hostname = hostname
        self._namespace = namespace
        self._control_namespace = control_namespace
        self._task_queues = task_queues
        self._spec = scheduled_stream(namespace)
        self._latest: dict[str, Parked] = {}
        self._members = QueueMembership()
        self._generation = 0  # of the subscription: records of an older one are not acked
        self.records_read = 0

    def listed(self, *, now: float | None = None) -> list[dict[str, Any]]:
        """Celery's ``scheduled`` reply: the parked tasks this worker lists, not yet due, soonest first."""
        moment = time.time() if now is None else now
        for task_id in [tid for tid, parked in self._latest.items() if parked.eta <= moment]:
            del self._latest[task_id]  # came due: back in its task queue, or run
        members = self._consumers(moment)
        mine = sorted((p for p in self._latest.values() if self._lists(p, members)), key=lambda p: p.eta)
        return [parked.reply(self._hostname) for parked in mine]

    def find(self, task_id: str, *, now: float | None = None) -> dict[str, Any] | None:
        """The TASK_INFO of ``task_id`` if this worker lists it as scheduled (``query_task``)."""
        parked = self._latest.get(task_id)
        moment = time.time() if now is None else now
        if parked is None or parked.eta <= moment or not self._lists(parked, self._consumers(moment)):
            return None
        return parked.request(self._hostname)

    def _consumers(self, now: float) -> dict[str, Collection[str]]:
        # The live workers by their last heartbeat, and this one as it is now (its own heartbeat
        # may lag a queue it just added, and without the members stream it sees only itself).
        members: dict[str, Collection[str]] = dict(self._members.consumers(now))
        members[self._hostname] = frozenset(self._task_queues())
        return members

    def _lists(self, parked: Parked, members: dict[str, Collection[str]]) -> bool:
        if parked.hostname is not None:
            return parked.hostname == self._hostname
        # A client's park: one consumer of its queue lists it (an old record without a queue: none).
        return parked.queue is not None and lister_of(parked.task_id, parked.queue, members) == self._hostname

    async def follow(self, channel: Callable[[], Awaitable[aio_pika.abc.AbstractChannel]]) -> None:
        """Subscribe from the stream's start, and to the members stream, again after each failure;
        until cancelled."""
        attempt = 0
        while True:
            opened: list[aio_pika.abc.AbstractChannel] = []
            try:
                # The members first: once the records flow, a declare's answer waits behind them.
                members = await self._follow_members(await channel())
                if members is not None:
                    opened.append(members)
                records = await channel()
                opened.append(records)
                await records.set_qos(prefetch_count=_PREFETCH)
                spec = self._spec
                queue = await records.declare_queue(spec.name, durable=spec.durable, arguments=spec.arguments)
                self._latest.clear()  # read again from the start
                on_record = functools.partial(self._on_record, generation=self._generation)
                await queue.consume(on_record, arguments={"x-stream-offset": "first"})
                log.debug("scheduled_log_subscribed", queue=spec.name, members=members is not None)
                attempt = 0
                # Until either channel (or their connection) ends, however it ends: subscribe again.
                # The channels' own futures: waited on, never cancelled (their connection owns them).
                closing = [(await each.get_underlay_channel()).closing for each in opened]
                done, _ = await asyncio.wait(closing, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    if not future.cancelled():
                        future.exception()  # however it ended: subscribe again
            except asyncio.CancelledError:
                raise
            except (aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                pause_s = _RETRY_PAUSES_S[min(attempt, len(_RETRY_PAUSES_S) - 1)]
                attempt += 1
                log.warning(
                    "scheduled_log_retrying", queue=self._spec.name, error=str(exc), retry_in_s=pause_s
                )
                await asyncio.sleep(pause_s)
            finally:
                # No ack starts on these channels from now on: one written after the close would be
                # a frame on a closed channel, which the broker answers by closing the connection.
                self._generation += 1
                for each in reversed(opened):  # the records first: they flood at the start
                    if not each.is_closed:
                        with contextlib.suppress(
                            aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError
                        ):
                            await each.close()

    async def _follow_members(
        self, channel: aio_pika.abc.AbstractChannel
    ) -> aio_pika.abc.AbstractChannel | None:
        # Without the members stream this worker sees itself alone: it lists every client park on
        # its queues, as each of its peers does (listed more than once rather than by no one).
        feed = AsyncMembersFeed(self._members, namespace=self._control_namespace, accept=self._same_app)
        try:
            await feed.follow(channel)
        except aio_pika.exceptions.AMQPError as exc:
            log.warning("scheduled_log_members_unavailable", error=str(exc))
            return None
        return channel

    def _same_app(self, event: Mapping[str, Any]) -> bool:
        # Clockwork workers of our app namespace list client parks; a Celery worker never does.
        namespace = event.get("app_namespace", LEGACY_NAMESPACE)
        return event.get("sw_ident") == SW_IDENT and namespace == self._namespace

    async def _on_record(self, message: aio_pika.abc.AbstractIncomingMessage, *, generation: int) -> None:
        if generation != self._generation:
            return  # its channel is closing, and a new subscription reads from the start
        try:
            parked = Parked.decode(message.body)
        except MessageError as exc:
            log.warning("scheduled_record_refused", error=str(exc), size=len(message.body))
        else:
            self.records_read += 1
            if parked.eta > time.time():
                self._latest[parked.task_id] = parked
            else:
                self._latest.pop(parked.task_id, None)
        # A stream hands out more records only as earlier ones are acked.
        with contextlib.suppress(aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError):
            await message.ack()  # its channel was lost: the next subscription reads from the start
