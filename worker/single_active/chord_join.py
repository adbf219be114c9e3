"""The chord joiner: counts each chord's parts in the broker and sends its body exactly once.

Every header task of a chord ends by leaving a part in the join queue (worker/consume/canvas.py):
its index, the chord's size, its state and result, and the body. Every worker subscribes to that
queue, which has a single active consumer: one worker of the cluster joins at a time.

The joiner holds each part unacked until its chord is settled, so what it knows is always what the
broker holds: if it dies or loses its connection, the broker hands every part to the next active
joiner, which rebuilds the same chords. Its channel is transactional, and the body and the acks
of all its chord's parts are committed together: either the body is sent and its parts gone, or
neither, so the body is sent once however often joiners fail over. A header task run twice (its
worker died before acking it) sends its part twice; the index keys the part, so the copy counts
once and is acked with the rest.

A failed (or revoked, or refused) header task fails the chord at once: the body's caller gets a
``ChordError`` naming it, the body's errbacks are sent, and the body never runs. The chord's
other parts are still held until all are in, so its end is still known after a failover.
Nothing polls: the joiner only acts when a part arrives.

A copy of a part can also come after its chord was settled: a header's worker died between
sending its part and acking its task, and the task ran again later. The transaction that settles
a chord also publishes the chord's marker to the record of settled chords (a stream; see
settled_chords.py), and a joiner that becomes the active one reads that record before it takes a
part. So a late copy is acked (``chord_part_late``), whichever joiner settled its chord, and a
chord whose whole header ran again never sends its body twice.

Known limit: the record keeps a day of settled chords, at most 64 MB of markers (about 290,000
chords; see ``settled_chords_stream``). A copy later than that is taken for a new chord: held and
logged after ``STALE_AFTER_S`` as one that never completes, or, if it is a whole chord by itself
(a header of one task), its body is sent again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions
import structlog
from aiormq import spec

from broker_svc.app import App
from broker_svc.canvas.follow_ups import FollowUp, as_list, follow_ups
from broker_svc.clock import LamportClock
from broker_svc.topology import chord_join_queue, dead_letter_queue
from broker_svc.wire import codec
from broker_svc.wire.records.chord_part import (
    ChordGrowth,
    ChordPart,
    decode_part,
    encode_part,
    join_namespace,
)
from broker_svc.wire.results.message import Outcome, wire_exception
from broker_svc.wire.results.meta import is_redis_url, result_meta
from broker_svc.wire.task.states import State
from broker_svc.wire.task.task_message import CLOCK_HEADER, TaskMessage, WireMessage, encode_task
from control.aio.declare import declare_queue

if TYPE_CHECKING:
    from broker_svc.redis_results.writer import ResultWriter
from worker.amqp.connection import one_time_channel
from worker.rules.canvas_plan import follow_up_queue
from worker.single_active.resubscribe import resubscribing
from worker.single_active.settled_chords import SettledChords

__all__ = ["STALE_AFTER_S", "ChordJoiner"]

log = structlog.get_logger(__name__)

# How long a joiner that has just become the active one may take to read the record of settled
# chords; past it, it closes its channel and the broker moves the parts on. A full record (64 MB)
# took about a minute on a busy 2-core machine: the bound is well above it, or no joiner could join.
_CATCH_UP_S: Final = 300.0
# A chord with no new part for this long is logged (once per period) as waiting.
STALE_AFTER_S: Final = 3600.0


@dataclass(slots=True)
class _Chord:
    size: int
    parts: dict[int, ChordPart] = field(default_factory=dict)
    # Tasks added by its header tasks (add_to_chord), in the order told, and their parts by id.
    added: list[str] = field(default_factory=list)
    added_parts: dict[str, ChordPart] = field(default_factory=dict)
    held: list[aio_pika.abc.AbstractIncomingMessage] = field(default_factory=list)
    failed: bool = False
    content_type: str = codec.JSON
    last_part_at: float = field(default_factory=time.monotonic)

    @property
    def complete(self) -> bool:
        return len(self.parts) >= self.size and all(task_id in self.added_parts for task_id in self.added)

    def ordered(self) -> list[ChordPart]:
        """Every part in header order; an added task's right after its adder's, in the order added."""
        rank = {task_id: n for n, task_id in enumerate(self.added, start=1)}
        every = [*self.parts.values(), *(self.added_parts[task_id] for task_id in self.added)]
        return sorted(every, key=lambda part: (part.index, rank.get(part.task_id, 0)))


class ChordJoiner:
    """Joins the chords whose parts reach this worker's join queue subscription.

    Args:
        app: the worker's app (routes and queue types for the body).
        clock: the worker's Lamport clock (stamped on what it sends).
        namespace: the control namespace, which names the join queue.
        max_body_bytes: parts larger than this are refused (dead-lettered).
    """

    def __init__(self, *, app: App, clock: LamportClock, namespace: str, max_body_bytes: int) -> None:
        self._app = app
        self._clock = clock
        self._namespace = namespace
        self._queue = chord_join_queue(namespace)
        self._max_bytes = max_body_bytes
        self._chords: dict[str, _Chord] = {}
        self._settled = SettledChords(namespace)
        # Read on the first part of each subscription: only then is this joiner the active one.
        self._caught_up = False
        self._lock = asyncio.Lock()
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aiormq.abc.AbstractChannel | None = None
        self._declared: set[str] = set()
        self.fired = 0
        # With a Redis result backend, a failed chord's body is stored there too (made on first use).
        self._redis: ResultWriter | None = None

    @property
    def waiting(self) -> int:
        """Chords with some, not all, of their parts in (this joiner's view)."""
        return len(self._chords)

    async def run(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        """Subscribe to the join queue, and again whenever the subscription is lost; until cancelled."""
        await resubscribing(
            lambda: self._serve(connection),
            forget=self._forget_held,
            log=log,
            event="chord_joiner_resubscribing",
        )

    async def _serve(self, connection: aio_pika.abc.AbstractRobustConnection) -> bool:
        # Returns once the subscription is lost; True if it was made at all.
        channel = await one_time_channel(connection)  # not robust: see gatekeeper._serve
        try:
            await self._settled.declare(channel)  # a joiner that cannot keep the record must not join
            queue = await declare_queue(channel, self._queue)
            await channel.set_qos(prefetch_count=0)  # a chord's parts are all held until it settles
            underlay = await channel.get_underlay_channel()
            await underlay.tx_select()
            self._connection, self._channel = connection, underlay
            self._declared.clear()
            await queue.consume(self._on_message)
            log.debug("chord_joiner_subscribed", queue=self._queue.name)
            try:
                await underlay.closing
            except Exception as exc:  # the channel's end, however it came
                log.info("chord_joiner_channel_closed", error=f"{type(exc).__name__}: {exc}")
            return True
        finally:
            self._channel = None
            if not channel.is_closed:
                try:
                    async with asyncio.timeout(5):
                        await channel.close()
                except Exception as exc:  # closing a channel of a lost connection: nothing to undo
                    log.debug("chord_joiner_channel_close_failed", error=str(exc))

    def _forget_held(self) -> None:
        # The broker returned every unacked part to the queue with the channel: start afresh. Another
        # joiner may settle chords before this one is active again: read the record again then.
        self._chords.clear()
        self._caught_up = False

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with self._lock:
            channel = self._channel
            try:
                current = channel is not None and message.channel is channel
            except aiormq.exceptions.ChannelInvalidStateError:
                current = False
            if channel is None or not current:
                return  # from a channel already lost: the broker has requeued it
            try:
                if not self._caught_up:
                    await self._catch_up()
                await self._take(channel, message)
            except Exception as exc:
                # A failed transaction: close the channel, so the broker requeues every held part
                # and the next subscription (here or on another worker) starts from the broker's state.
                log.error("chord_join_failed", error=f"{type(exc).__name__}: {exc}")
                await channel.close()

    async def _catch_up(self) -> None:
        # Before the first part this joiner takes as the active one: every chord settled by those
        # before it (their channels were closed before this part came) is in the record by now.
        assert self._connection is not None
        started = time.monotonic()
        read = await self._settled.catch_up(self._connection, timeout_s=_CATCH_UP_S)
        self._caught_up = True
        log.info(
            "chord_settled_record_read",
            markers=read,
            remembered=len(self._settled),
            ms=round((time.monotonic() - started) * 1000, 1),
        )

    async def _take(
        self, channel: aiormq.abc.AbstractChannel, message: aio_pika.abc.AbstractIncomingMessage
    ) -> None:
        try:
            part = decode_part(message.body, message.content_type, max_bytes=self._max_bytes)
        except ValueError as exc:
            await self._dead_letter(channel, message, str(exc))
            return
        if part.group_id in self._settled:
            late = (
                {"added": len(part.added)}
                if isinstance(part, ChordGrowth)
                else {"index": part.index, "task_id": part.task_id}
            )
            log.info("chord_part_late", group_id=part.group_id, **late)
            await message.ack()
            await channel.tx_commit()
            return
        chord = self._chords.get(part.group_id)
        if chord is None:
            chord = self._chords[part.group_id] = _Chord(
                size=part.size, content_type=message.content_type or codec.JSON
            )
        chord.held.append(message)
        chord.last_part_at = time.monotonic()
        if isinstance(part, ChordGrowth):
            chord.added.extend(task_id for task_id in part.added if task_id not in chord.added)
            log.info("chord_grown", group_id=part.group_id, added=len(part.added), size=chord.size)
        else:
            # A copy of a part is keyed as the part: by task id for an added task, else by index.
            if part.task_id in chord.added:
                fresh = chord.added_parts.setdefault(part.task_id, part) is part
            else:
                fresh = chord.parts.setdefault(part.index, part) is part
            if not fresh:
                log.info(
                    "chord_part_duplicate", group_id=part.group_id, index=part.index, task_id=part.task_id
                )
            if part.state != State.SUCCESS.value and not chord.failed:
                chord.failed = True
                await self._fail(channel, chord, part)
        if chord.complete:
            if not chord.failed:
                await self._fire(channel, chord)
            for held in chord.held:
                await held.ack()
            await self._settled.publish(channel, part.group_id)
            await channel.tx_commit()  # the body (if any), every part's ack and the marker, together
            del self._chords[part.group_id]
            self._settled.add(part.group_id)
            if not chord.failed:
                self.fired += 1
                log.info("chord_body_sent", group_id=part.group_id, size=chord.size)
            log.info("chord_settled", group_id=part.group_id, size=chord.size, failed=chord.failed)

    async def _fire(self, channel: aiormq.abc.AbstractChannel, chord: _Chord) -> None:
        ordered = chord.ordered()
        last = ordered[-1]
        results = [p.result for p in ordered]
        parent = self._parent(last, chord.content_type)
        for item in follow_ups(last.body, parent=parent, partial=(results,)):
            await self._send_task(channel, item)

    async def _fail(self, channel: aiormq.abc.AbstractChannel, chord: _Chord, part: ChordPart) -> None:
        # Celery's words: "Dependency <id> raised <exception>".
        cause = part.result if isinstance(part.result, dict) else {}
        shown = f"{cause.get('exc_type', part.state)}({cause.get('exc_message', '')!r})"
        error = wire_exception("ChordError", f"Dependency {part.task_id} raised {shown}")
        options = part.body.get("options") or {}
        body_id = options.get("task_id")
        reply_to = options.get("reply_to") or part.reply_to
        log.warning(
            "chord_failed", group_id=part.group_id, task_id=part.task_id, state=part.state, body_id=body_id
        )
        if isinstance(body_id, str):
            await self._store_failure(Outcome(task_id=body_id, status=State.FAILURE, result=error))
        if isinstance(body_id, str) and reply_to:
            outcome = Outcome(task_id=body_id, status=State.FAILURE, result=error)
            content_type = (
                chord.content_type if chord.content_type in (codec.JSON, codec.MSGPACK) else codec.JSON
            )
            payload, ctype, encoding = codec.encode(outcome.to_wire(), content_type)
            properties = spec.Basic.Properties(
                content_type=ctype, content_encoding=encoding, correlation_id=body_id, delivery_mode=2,
                headers={CLOCK_HEADER: self._clock.forward()},
            )  # fmt: skip
            await channel.basic_publish(payload, exchange="", routing_key=reply_to, properties=properties)
        # The body's errbacks run with its id, as after the body's own failure.
        parent = self._parent(part, chord.content_type, task_id=body_id if isinstance(body_id, str) else None)
        for errback in as_list(options.get("link_error")):
            for item in follow_ups(errback, parent=parent, partial=(parent.id,)):
                await self._send_task(channel, item)
        await self._fail_outer(channel, chord, part, error, body_id=parent.id)
        await channel.tx_commit()  # the failure is told now; the parts stay held until all are in

    async def _fail_outer(
        self, channel: aiormq.abc.AbstractChannel, chord: _Chord, part: ChordPart, error: Any, *, body_id: str
    ) -> None:
        # A chord nested in another's header (chord_header.py): its body was to leave a part of the
        # outer chord. It never runs, so its failure is that part, and the outer chord fails too
        # (Celery's workers leave the outer chord waiting forever).
        options = part.body.get("options") or {}
        outer, group_id, index = options.get("chord"), options.get("group_id"), options.get("group_index")
        if not isinstance(outer, Mapping) or not isinstance(group_id, str) or not isinstance(index, int):
            return
        size = outer.get("chord_size")
        if not isinstance(size, int):
            log.warning("chord_failure_not_passed_on", group_id=group_id, why="outer chord counted in Redis")
            return
        failed = ChordPart(
            group_id=group_id, index=index, size=size, task_id=body_id, state=State.FAILURE.value,
            result=error, body=dict(outer), reply_to=options.get("reply_to") or part.reply_to,
            root_id=part.root_id,
        )  # fmt: skip
        content_type = chord.content_type if chord.content_type in (codec.JSON, codec.MSGPACK) else codec.JSON
        payload, ctype, encoding = encode_part(failed, codec.serializer_of(content_type) or "json")
        queue = chord_join_queue(join_namespace(outer, self._namespace))
        if queue.name != self._queue.name and queue.name not in self._declared:
            await self._declare(queue)
            self._declared.add(queue.name)
        properties = spec.Basic.Properties(
            content_type=ctype, content_encoding=encoding, delivery_mode=2,
            headers={CLOCK_HEADER: self._clock.forward()},
        )  # fmt: skip
        await channel.basic_publish(payload, exchange="", routing_key=queue.name, properties=properties)
        log.info("chord_failure_passed_on", group_id=group_id, index=index, task_id=body_id)

    async def _store_failure(self, outcome: Outcome) -> None:
        # With a Redis result backend the body's ChordError is stored there, where a process that
        # did not send the chord reads it. Before the commit: if Redis does not take it (within
        # its retries), the transaction is not committed and the parts go to the next joiner.
        if not is_redis_url(self._app.conf.get("result_backend")):
            return
        from broker_svc.redis_results.backend_conf import RedisBackendConf  # lazy: needs redis-py
        from broker_svc.redis_results.connection import open_client
        from broker_svc.redis_results.writer import ResultWriter

        if self._redis is None:
            conf = RedisBackendConf.of(self._app.conf, self._app.settings)
            assert conf is not None
            self._redis = ResultWriter(open_client(conf.url), conf)
        meta = result_meta(outcome, group_id=None, parent_id=None, extended=None)
        await asyncio.to_thread(self._redis.store, meta)  # redis-py blocks: off the event loop

    def _parent(self, part: ChordPart, content_type: str, *, task_id: str | None = None) -> TaskMessage:
        # What a follow-up takes from the task before it: ids, result queue, content type.
        return TaskMessage(
            id=task_id or part.task_id,
            task="celery.chord",
            root_id=part.root_id,
            reply_to=part.reply_to,
            content_type=content_type if content_type in (codec.JSON, codec.MSGPACK) else codec.JSON,
        )

    async def _send_task(self, channel: aiormq.abc.AbstractChannel, item: FollowUp) -> None:
        message = item.message
        queue = follow_up_queue(self._app, item)
        if queue not in self._declared:
            await self._declare(self._app.settings.task_queue(queue))
            self._declared.add(queue)
        serializer = codec.serializer_of(message.content_type) or "msgpack"
        wire = encode_task(message, serializer=serializer)
        properties = _task_properties(wire, self._clock)
        await channel.basic_publish(wire.body, exchange="", routing_key=queue, properties=properties)
        log.info(
            "task_follow_up_sent", follow_up_id=message.id, follow_up=message.task, queue=queue, why="chord"
        )

    async def _declare(self, queue: Any) -> None:
        # Declared through aio-pika on the same channel would need its wrapper; the underlay is enough.
        channel = self._channel
        assert channel is not None
        options = queue.declare_options()
        await channel.queue_declare(queue.name, durable=options["durable"], arguments=options["arguments"])

    async def _dead_letter(
        self, channel: aiormq.abc.AbstractChannel, message: aio_pika.abc.AbstractIncomingMessage, why: str
    ) -> None:
        dead = dead_letter_queue(self._queue.name)
        if dead.name not in self._declared:
            await channel.queue_declare(dead.name, durable=True)
            self._declared.add(dead.name)
        log.error("chord_part_refused", error=why, size=len(message.body), content_type=message.content_type)
        properties = spec.Basic.Properties(
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            delivery_mode=2,
            headers={
                **(message.headers or {}),
                "x-clockwork-reason": "bad_chord_part",
                "x-clockwork-error": why,
            },
        )
        await channel.basic_publish(message.body, exchange="", routing_key=dead.name, properties=properties)
        await message.ack()
        await channel.tx_commit()

    def stale(self, *, now: float | None = None) -> list[str]:
        """The chords that had no new part for ``STALE_AFTER_S``."""
        moment = time.monotonic() if now is None else now
        return [gid for gid, chord in self._chords.items() if moment - chord.last_part_at > STALE_AFTER_S]

    async def watch(self) -> None:
        """Log, once per ``STALE_AFTER_S``, the chords still waiting for parts; until cancelled."""
        while True:
            await asyncio.sleep(STALE_AFTER_S)
            for group_id in self.stale():
                chord = self._chords.get(group_id)
                if chord is not None:
                    log.warning(
                        "chord_waiting", group_id=group_id, parts=len(chord.parts), size=chord.size,
                        hint="a header task of this chord has not ended yet, or this is a copy of a "
                        "part of a chord settled longer ago than the record of settled chords keeps",
                    )  # fmt: skip


def _task_properties(wire: WireMessage, clock: LamportClock) -> spec.Basic.Properties:
    """The AMQP properties of an encoded task the joiner sends, stamped with the worker's clock."""
    return spec.Basic.Properties(
        content_type=wire.content_type,
        content_encoding=wire.content_encoding,
        headers={**wire.headers, CLOCK_HEADER: clock.forward()},
        delivery_mode=wire.delivery_mode,
        correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
        priority=wire.priority,
        expiration=wire.expiration,
    )
