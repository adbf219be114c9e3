"""The dependents joiner: releases tasks sent with ``depends_on`` once their dependencies finish.

``app.enqueue(f, depends_on=[a, b])`` publishes the task to the dependents queue
(``topology.dependents_queue``) instead of its own, with the ids it waits for. Every worker
subscribes; the queue has a single active consumer, so one worker of the cluster holds every
waiting task unacked and follows the task-state stream from its start, where workers write each
task's outcome. When the last dependency of a held task is done, the joiner publishes it to its
queue and acks it in one transaction: it is released once, however often joiners fail over (a
joiner that dies leaves its held tasks to the broker, which hands them to the next one, and that
one learns the same outcomes from the stream). Nothing polls: it acts when a task or a record
arrives.

A dependency that ends other than SUCCESS (FAILURE, REVOKED, DELETED) releases its dependents
only with ``allow_failure``; otherwise they are dropped, REVOKED on the stream with the reason,
and their caller gets a FAILURE.

Limits: dependencies are looked up in the stream's retention (a day), so a dependency older than
that keeps its dependent waiting; the workers must write states (``task_states``).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Any, Final

import aio_pika
import aio_pika.abc
import aiormq.abc
import structlog
from aiormq import spec

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.settings import Settings
from broker_svc.topology import dependents_queue, task_states_stream
from broker_svc.wire import codec
from broker_svc.wire.records.task_state import (
    ALLOW_FAILURE_HEADER,
    CONTENT_TYPE,
    DEPENDS_ON_HEADER,
    FINAL_STATES,
    MARKER_HEADER,
    TARGET_QUEUE_HEADER,
    JobState,
    StateRecord,
)
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import CLOCK_HEADER
from control.aio.declare import declare_queue
from worker.amqp.connection import one_time_channel
from worker.single_active.resubscribe import resubscribing

__all__ = ["DependentsJoiner"]

log = structlog.get_logger(__name__)

_FINAL_KEPT: Final = 200_000
_STREAM_PREFETCH: Final = 1000
_OWN_HEADERS: Final = frozenset({DEPENDS_ON_HEADER, ALLOW_FAILURE_HEADER, TARGET_QUEUE_HEADER})


@dataclass(slots=True)
class _Held:
    message: aio_pika.abc.AbstractIncomingMessage
    task_id: str
    depends_on: tuple[str, ...]
    allow_failure: bool
    queue: str
    clock: int = 0  # the released copy's clock: its QUEUED record sorts before the run's STARTED


class DependentsJoiner:
    """Holds the tasks waiting for dependencies and releases each once they are done.

    Args:
        settings: the worker's settings (queue types of the released tasks).
        clock: the worker's Lamport clock.
        hostname: names this worker in the records it writes.
    """

    def __init__(self, *, settings: Settings, clock: LamportClock, hostname: str) -> None:
        self._settings = settings
        self._clock = clock
        self._hostname = hostname
        self._queue = dependents_queue(settings.namespace)
        self._stream = task_states_stream(settings.namespace)
        self._final: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._held: dict[str, _Held] = {}
        self._channel: aiormq.abc.AbstractChannel | None = None
        self._records: aio_pika.abc.AbstractChannel | None = None
        self._stream_queue: aio_pika.abc.AbstractQueue | None = None
        self._following = False
        self._lock = asyncio.Lock()
        self._declared: set[str] = set()
        self.released = 0

    async def run(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        """Subscribe, and again whenever the subscription is lost; until cancelled."""
        await resubscribing(
            lambda: self._serve(connection),
            forget=self._held.clear,
            log=log,
            event="dependents_resubscribing",
        )

    async def _serve(self, connection: aio_pika.abc.AbstractRobustConnection) -> bool:
        channel = await one_time_channel(connection)  # not robust: see gatekeeper._serve
        records = await one_time_channel(connection)
        try:
            queue = await declare_queue(channel, self._queue)
            await channel.set_qos(prefetch_count=0)  # every waiting task is held until released
            underlay = await channel.get_underlay_channel()
            await underlay.tx_select()
            self._channel, self._records = underlay, records
            self._declared.clear()
            self._final.clear()
            self._following = False
            self._stream_queue = await declare_queue(records, self._stream)
            await records.set_qos(prefetch_count=_STREAM_PREFETCH)  # streams need a qos and acks
            await queue.consume(self._on_waiting)
            log.debug("dependents_subscribed", queue=self._queue.name)
            try:
                await underlay.closing
            except Exception as exc:  # the channel's end, however it came
                log.info("dependents_channel_closed", error=f"{type(exc).__name__}: {exc}")
            return True
        finally:
            self._channel = self._records = None
            self._stream_queue = None
            for each in (channel, records):
                if not each.is_closed:
                    try:
                        async with asyncio.timeout(5):
                            await each.close()
                    except Exception as exc:  # closing a channel of a lost connection
                        log.debug("dependents_channel_close_failed", error=str(exc))

    # -- the stream: which tasks are done --------------------------------------------------------

    async def _on_record(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await message.ack()
        if MARKER_HEADER in (message.headers or {}):
            return
        try:
            record = StateRecord.decode(message.body)
        except MessageError:
            return
        self._clock.adjust(record.clock)
        if record.state not in FINAL_STATES or record.task_id in self._final:
            return  # the first end of a task is its end (a late QUEUED changes nothing)
        self._final[record.task_id] = record.state
        if len(self._final) > _FINAL_KEPT:
            self._final.popitem(last=False)
        waiting = [held for held in self._held.values() if record.task_id in held.depends_on]
        for held in waiting:
            await self._settle_if_ready(held)

    # -- the queue: who waits for what ------------------------------------------------------------

    async def _on_waiting(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        headers = message.headers or {}
        task_id, depends_on = headers.get("id"), headers.get(DEPENDS_ON_HEADER)
        queue = headers.get(TARGET_QUEUE_HEADER)
        if (
            not isinstance(task_id, str)
            or not isinstance(depends_on, list | tuple)
            or not isinstance(queue, str)
        ):
            log.error("dependent_refused", why="no id, depends_on or target queue", size=len(message.body))
            await message.ack()  # nothing could ever release it
            if self._channel is not None:
                await self._channel.tx_commit()
            return
        held = _Held(
            message,
            task_id,
            tuple(str(d) for d in depends_on),
            bool(headers.get(ALLOW_FAILURE_HEADER)),
            queue,
        )
        self._held[task_id] = held
        log.info("dependent_held", task_id=task_id, depends_on=list(held.depends_on))
        if not self._following and self._stream_queue is not None:
            # The stream is read only by the active joiner, from when it first holds a task: the
            # other workers' subscriptions receive nothing and read nothing.
            self._following = True
            await self._stream_queue.consume(self._on_record, arguments={"x-stream-offset": "first"})
        await self._settle_if_ready(held)

    async def _settle_if_ready(self, held: _Held) -> None:
        async with self._lock:
            if self._held.get(held.task_id) is not held:
                return  # settled meanwhile
            ends = [self._final.get(dep) for dep in held.depends_on]
            if any(end is None for end in ends):
                return
            failed = [
                (dep, end) for dep, end in zip(held.depends_on, ends, strict=True) if end != JobState.SUCCESS
            ]
            channel = self._channel
            if channel is None:
                return
            releasing = not failed or held.allow_failure
            try:
                if releasing:
                    await self._release(channel, held)
                    # On the stream before the commit lets a worker start the task: its history
                    # reads QUEUED before STARTED, however busy this process is.
                    await self._write(held, JobState.QUEUED, {"released_by": "depends_on"})
                else:
                    await self._drop(channel, held, failed)
                await held.message.ack()
                await channel.tx_commit()  # the release (or the failure reply) and the ack, together
            except Exception as exc:
                log.error(
                    "dependent_release_failed", task_id=held.task_id, error=f"{type(exc).__name__}: {exc}"
                )
                await channel.close()  # the broker requeues what is held; the next joiner starts afresh
                if releasing:  # it waits again, as the stream then says
                    await self._write(held, JobState.WAITING, {"reason": "release failed"})
                return
            del self._held[held.task_id]
        if releasing:
            self.released += 1
            log.info("dependent_released", task_id=held.task_id, queue=held.queue)
        else:
            await self._write(
                held, JobState.REVOKED, {"reason": f"dependency {failed[0][0]} ended {failed[0][1]}"}
            )

    async def _release(self, channel: aiormq.abc.AbstractChannel, held: _Held) -> None:
        message = held.message
        if held.queue not in self._declared:
            spec_ = self._settings.task_queue(held.queue)
            options = spec_.declare_options()
            await channel.queue_declare(
                spec_.name, durable=options["durable"], arguments=options["arguments"]
            )
            self._declared.add(held.queue)
        headers = {k: v for k, v in (message.headers or {}).items() if k not in _OWN_HEADERS}
        held.clock = headers[CLOCK_HEADER] = self._clock.forward()
        properties = spec.Basic.Properties(
            content_type=message.content_type, content_encoding=message.content_encoding, headers=headers,
            delivery_mode=2, priority=message.priority, correlation_id=message.correlation_id,
            reply_to=message.reply_to,
        )  # fmt: skip
        await channel.basic_publish(message.body, exchange="", routing_key=held.queue, properties=properties)

    async def _drop(
        self, channel: aiormq.abc.AbstractChannel, held: _Held, failed: list[tuple[str, Any]]
    ) -> None:
        dep, end = failed[0]
        log.warning("dependent_dropped", task_id=held.task_id, dependency=dep, state=end)
        reply_to = held.message.reply_to
        if not reply_to:
            return
        error = wire_exception("DependencyFailed", f"dependency {dep} ended {end}")
        content_type = (
            held.message.content_type
            if held.message.content_type in (codec.JSON, codec.MSGPACK)
            else codec.JSON
        )
        payload, ctype, encoding = codec.encode(
            Outcome(task_id=held.task_id, status=State.FAILURE, result=error).to_wire(), content_type
        )
        properties = spec.Basic.Properties(
            content_type=ctype, content_encoding=encoding, correlation_id=held.task_id, delivery_mode=2,
            headers={CLOCK_HEADER: self._clock.forward()},
        )  # fmt: skip
        await channel.basic_publish(payload, exchange="", routing_key=reply_to, properties=properties)

    async def _write(self, held: _Held, state: JobState, info: dict[str, Any]) -> None:
        channel = self._records
        if channel is None:
            return
        name = (held.message.headers or {}).get("task")
        clock = held.clock if state == JobState.QUEUED and held.clock else self._clock.forward()
        record = StateRecord(
            task_id=held.task_id, state=state.value, at=time.time(), clock=clock,
            hostname=self._hostname, name=name if isinstance(name, str) else None, queue=held.queue,
            info=info,
        )  # fmt: skip
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    record.encode(), content_type=CONTENT_TYPE, delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                ),
                routing_key=self._stream.name,
            )
        except aio_pika.exceptions.AMQPError as exc:
            log.warning("task_state_not_written", state=state.value, error=str(exc))
