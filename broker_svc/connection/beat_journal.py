"""A scheduler's journal and snapshot on the broker (blocking pika): read back, append, follow.

``Journal`` reads the state back (the latest snapshot, then every journal record after it, up to
a marker it writes, so nothing written before the call is missed), appends schedule changes,
and saves snapshots. ``JournalFollower`` follows the journal from an offset on a thread of its
own, handing each record over as ``(offset, item)``. Records are in
``broker_svc/schedules/journal_record.py``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from broker_svc.connection.blocking import open_blocking
from broker_svc.errors import BrokerUnavailable, MessageError, Unroutable
from broker_svc.logging import get_logger
from broker_svc.schedules.journal_record import (
    CONTENT_TYPE,
    RECORD_HEADER,
    Change,
    JournalItem,
    Marker,
    TermOpened,
    classify,
)
from broker_svc.schedules.state import BeatState
from broker_svc.settings import Settings
from broker_svc.topology import (
    DEFAULT_EXCHANGE,
    QueueSpec,
    beat_journal_stream,
    beat_router_exchange,
    beat_snapshot_queue,
    beat_term_exchange,
)

__all__ = ["Journal", "JournalFollower", "JournalRecord"]

log = get_logger(__name__)

JournalRecord = tuple[int, JournalItem]  # (stream offset, record)

_PREFETCH: Final = 1000
_ACK_EVERY: Final = 500
_RECONNECT_PAUSE_S: Final = 0.5


def _connect(settings: Settings, name: str) -> tuple[pika.BlockingConnection, BlockingChannel]:
    # pika tries the failover URLs in turn, as the state feed's connection does.
    conn = open_blocking(settings, connection_name=name)
    return conn, conn.channel()


def _declare(channel: BlockingChannel, *specs: QueueSpec) -> None:
    for spec in specs:
        channel.queue_declare(spec.name, **spec.declare_options())


def _item(props: pika.spec.BasicProperties, body: bytes) -> JournalItem | None:
    try:
        return classify(props.headers, props.correlation_id, props.content_type, body)
    except MessageError as exc:
        log.warning("beat_journal_record_skipped", error=str(exc))
        return None


class Journal:
    """The journal and snapshot of the scheduler ``name``; each call opens a connection of its own.

    Raises (every method):
        BrokerUnavailable: the broker could not be reached, or did not answer within ``timeout_s``.
    """

    def __init__(self, settings: Settings, name: str) -> None:
        self._settings = settings
        self.name = name
        self._namespace = settings.namespace
        self.stream = beat_journal_stream(name, self._namespace)
        self.snapshot_queue = beat_snapshot_queue(name, self._namespace)

    def read_state(
        self, since: tuple[BeatState, int] | None = None, *, timeout_s: float = 30.0
    ) -> tuple[BeatState, int]:
        """The state as of now, and the offset of the last record it covers (-1: none).

        ``since``: a state read before and its offset, to bring up to date (else the snapshot's).
        """
        conn, channel = _connect(self._settings, f"clockwork-beat-read-{self.name}")
        try:
            _declare(channel, self.stream, self.snapshot_queue)
            state, offset = since if since is not None else self._snapshot(channel)
            marker = str(uuid.uuid4())
            channel.confirm_delivery()
            self._publish(channel, marker.encode(), "marker")
            return self._read_up_to(conn, channel, state, offset, marker, timeout_s)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"reading the journal of scheduler {self.name!r}: {exc!r}") from exc
        finally:
            _close(conn)

    def append(self, change: Change) -> None:
        """Write a schedule change, confirmed: the leader applies it when it reads it."""
        self._with_channel(lambda channel: self._publish(channel, change.encode(), "change"))

    def save_snapshot(self, state: BeatState, offset: int) -> None:
        """Save the state covering the journal up to ``offset``; it replaces the one before."""
        # default=repr: a configured entry's arguments need not be JSON; that copy is for listing.
        snapshot = {"offset": offset, "state": state.to_json(), "at": time.time()}
        body = json.dumps(snapshot, default=repr).encode()

        def publish(channel: BlockingChannel) -> None:
            props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
            channel.basic_publish(DEFAULT_EXCHANGE, self.snapshot_queue.name, body, props, mandatory=True)

        self._with_channel(publish)

    def fence(self, epochs: Iterable[int]) -> None:
        """Delete the term exchanges of ``epochs``: a publish from their leaders is refused (404)."""

        def delete(channel: BlockingChannel) -> None:
            for epoch in epochs:
                channel.exchange_delete(beat_term_exchange(self.name, self._namespace, epoch).name)

        self._with_channel(delete)

    def open_term(self, epoch: int, *, leader: str = "") -> None:
        """Declare the router and the term's exchange bound to it, bind the journal to the router,
        and record the term (so the next leader deletes its exchange) with its ``leader``."""
        router, term = (
            beat_router_exchange(self.name, self._namespace),
            beat_term_exchange(self.name, self._namespace, epoch),
        )

        def open_(channel: BlockingChannel) -> None:
            for exchange in (router, term):
                channel.exchange_declare(exchange.name, exchange.type, **exchange.declare_options())
            channel.queue_bind(self.stream.name, router.name, self.stream.name)
            channel.exchange_bind(destination=router.name, source=term.name)
            self._publish(channel, TermOpened(epoch, leader, time.time()).encode(), "term")

        self._with_channel(open_)

    def route_queue(self, spec: QueueSpec) -> None:
        """Declare a task queue as a client sending to it would, and bind it to the router by its name."""
        router = beat_router_exchange(self.name, self._namespace).name

        def route(channel: BlockingChannel) -> None:
            _declare(channel, spec)
            if spec.exchange is not None:
                channel.exchange_declare(
                    spec.exchange.name, spec.exchange.type, **spec.exchange.declare_options()
                )
                channel.queue_bind(spec.name, spec.exchange.name, spec.routing_key)
            channel.queue_bind(spec.name, router, spec.name)

        self._with_channel(route)

    def route_exchange(self, exchange: str, routing_key: str) -> None:
        """Bind a named exchange (an entry's ``exchange=``) to the router by the entry's routing key.

        Raises:
            Unroutable: the exchange does not exist (declare it first).
        """
        router = beat_router_exchange(self.name, self._namespace).name
        try:
            self._with_channel(lambda channel: channel.exchange_bind(exchange, router, routing_key))
        except BrokerUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, pika.exceptions.ChannelClosedByBroker) and cause.reply_code == 404:
                raise Unroutable(
                    f"no exchange {exchange!r}: declare it before the schedule sends to it"
                ) from exc
            raise

    def _with_channel(self, action: Callable[[BlockingChannel], None]) -> None:
        conn, channel = _connect(self._settings, f"clockwork-beat-write-{self.name}")
        try:
            _declare(channel, self.stream, self.snapshot_queue)
            channel.confirm_delivery()
            action(channel)
        except pika.exceptions.AMQPError as exc:
            raise BrokerUnavailable(f"writing the journal of scheduler {self.name!r}: {exc!r}") from exc
        finally:
            _close(conn)

    def _publish(self, channel: BlockingChannel, body: bytes, kind: str) -> None:
        props = pika.BasicProperties(
            content_type=CONTENT_TYPE, delivery_mode=2, headers={RECORD_HEADER: kind}
        )
        channel.basic_publish(DEFAULT_EXCHANGE, self.stream.name, body, props, mandatory=True)

    def _snapshot(self, channel: BlockingChannel) -> tuple[BeatState, int]:
        # A peek: get the one message, then hand it back.
        method, _props, body = channel.basic_get(self.snapshot_queue.name, auto_ack=False)
        if method is None:
            return BeatState(), -1
        channel.basic_nack(method.delivery_tag, requeue=True)
        try:
            value = json.loads(body)
            return BeatState.from_json(value["state"]), int(value["offset"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("beat_snapshot_unreadable", scheduler=self.name, error=str(exc))
            return BeatState(), -1  # read the whole journal instead

    def _read_up_to(
        self,
        conn: pika.BlockingConnection,
        channel: BlockingChannel,
        state: BeatState,
        offset: int,
        marker: str,
        timeout_s: float,
    ) -> tuple[BeatState, int]:
        done = False
        last = offset

        def on_message(
            ch: BlockingChannel,
            method: pika.spec.Basic.Deliver,
            props: pika.spec.BasicProperties,
            body: bytes,
        ) -> None:
            nonlocal done, last
            position = (props.headers or {}).get("x-stream-offset")
            if isinstance(position, int):
                if position <= last:
                    return  # a chunk starts before the offset asked for
                last = position
            item = _item(props, body)
            if isinstance(item, Marker) and item.id == marker:
                done = True
            elif item is not None:
                state.apply(item)
            if done or method.delivery_tag % _ACK_EVERY == 0:
                ch.basic_ack(method.delivery_tag, multiple=True)

        channel.basic_qos(prefetch_count=_PREFETCH)
        start: Any = offset + 1 if offset >= 0 else "first"
        channel.basic_consume(self.stream.name, on_message, arguments={"x-stream-offset": start})
        deadline = time.monotonic() + timeout_s
        while not done:
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"the journal of scheduler {self.name!r} was not read within {timeout_s} s"
                )
            conn.process_data_events(time_limit=0.2)
        return state, last


def _close(conn: pika.BlockingConnection) -> None:
    if conn.is_open:
        try:
            conn.close()
        except Exception:  # closing a broken connection: nothing left to do
            pass


class JournalFollower:
    """Follows the journal from ``start`` on a daemon thread; records arrive on :attr:`records`.

    Reconnects after a lost connection and resumes after the last record handed over.
    """

    def __init__(self, settings: Settings, name: str, *, start: int) -> None:
        self._settings = settings
        self._stream = beat_journal_stream(name, settings.namespace)
        self._next = start
        self.records: queue.Queue[JournalRecord] = queue.Queue()
        self._closing = threading.Event()
        self._unacked = 0
        self._thread = threading.Thread(target=self._run, name=f"clockwork-beat-follow-{name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(timeout=3.0)

    def _run(self) -> None:
        while not self._closing.is_set():
            conn: pika.BlockingConnection | None = None
            try:
                conn, channel = _connect(self._settings, f"clockwork-beat-follow-{self._stream.name}")
                _declare(channel, self._stream)
                channel.basic_qos(prefetch_count=_PREFETCH)
                channel.basic_consume(
                    self._stream.name, self._on_message, arguments={"x-stream-offset": self._next}
                )
                while not self._closing.is_set():
                    conn.process_data_events(time_limit=0.2)
            except (pika.exceptions.AMQPError, OSError, BrokerUnavailable) as exc:
                log.warning("beat_journal_follow_lost", error=str(exc) or type(exc).__name__)
            finally:
                if conn is not None:
                    _close(conn)
            self._closing.wait(_RECONNECT_PAUSE_S)

    def _on_message(
        self,
        channel: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        position = (props.headers or {}).get("x-stream-offset")
        if isinstance(position, int):
            if position < self._next:
                return  # a chunk starts before the offset asked for
            self._next = position + 1
            item = _item(props, body)
            if item is not None:
                self.records.put((position, item))
        self._unacked += 1
        if self._unacked >= _ACK_EVERY:
            self._unacked = 0
            channel.basic_ack(method.delivery_tag, multiple=True)
