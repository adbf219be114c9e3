"""The state feed: a background reader of the task-state stream, indexed by task id (blocking pika).

One thread, one connection of its own. It reads the stream from its first retained record (or a
given time) and follows it, keeping the records of the most recent ``max_tasks`` task ids. A
question (``history``) first appends a marker and waits until the feed has read up to it, so the
answer includes every record written before the question was asked: a task the feed has not
seen by then is UNKNOWN, not merely not read yet.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Final

import pika
import pika.exceptions
import pika.spec
from pika.adapters.blocking_connection import BlockingChannel

from broker_svc.clock import LamportClock
from broker_svc.connection.blocking import open_blocking
from broker_svc.errors import BrokerUnavailable, MessageError
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.topology import DEFAULT_EXCHANGE, task_states_stream
from broker_svc.wire.records.task_state import MARKER_HEADER, StateRecord

__all__ = ["StateFeed"]

log = get_logger(__name__)

_PREFETCH: Final = 2000
_ACK_EVERY: Final = 500
_HISTORY_PER_TASK: Final = 64
_RECONNECT_PAUSE_S: Final = 0.5


class StateFeed:
    """Follows the task-state stream in a daemon thread; thread-safe questions by task id.

    Args:
        settings: the broker to read from.
        max_tasks: task ids kept (least recently written dropped first): bounds the memory.
        clock: adjusted from every record read, so what this process writes next sorts after it.
        since: start at this time instead of the first retained record.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: LamportClock | None = None,
        max_tasks: int = 200_000,
        since: dt.datetime | None = None,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._max_tasks = max_tasks
        self._offset: Any = since if since is not None else "first"
        self._index: OrderedDict[str, list[tuple[int, StateRecord]]] = OrderedDict()
        self._seen_markers: set[str] = set()
        self._cond = threading.Condition()
        self._seq = 0
        self._conn: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self._closing = False
        self._closed = threading.Event()  # wakes the reconnect pause
        self._error: str | None = None
        self._unacked = 0
        self._thread = threading.Thread(target=self._run, name="clockwork-state-feed", daemon=True)
        self._thread.start()

    # -- questions (any thread) --------------------------------------------------------------------

    def history(self, task_id: str, *, timeout: float = 10.0) -> list[StateRecord]:
        """Every record of ``task_id`` within retention, in Lamport order (empty: unknown).

        Raises:
            BrokerUnavailable: the feed could not read up to now within ``timeout``.
        """
        self.sync(timeout=timeout)
        with self._cond:
            records = list(self._index.get(task_id, ()))
        records.sort(key=lambda item: (item[1].clock, item[0]))
        return [record for _, record in records]

    def sync(self, *, timeout: float = 10.0) -> None:
        """Wait until the feed has read every record written before this call.

        Raises:
            BrokerUnavailable: not caught up within ``timeout`` (the broker is unreachable).
        """
        marker = str(uuid.uuid4())
        deadline = time.monotonic() + timeout
        sent = False
        with self._cond:
            while marker not in self._seen_markers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerUnavailable(
                        f"the task-state stream was not read up to now within {timeout} s"
                        + (f": {self._error}" if self._error else "")
                    )
                conn = self._conn
                if not sent and conn is not None:
                    try:
                        conn.add_callback_threadsafe(lambda: self._mark(marker))
                        sent = True
                    except Exception:  # the connection closed meanwhile: try on the next one
                        sent = False
                self._cond.wait(min(left, 0.2))
                if self._conn is not conn:
                    sent = False  # a new connection: the marker may have been lost with the old
            self._seen_markers.discard(marker)

    def close(self, timeout: float = 3.0) -> None:
        """Stop the thread and close its connection, waiting at most ``timeout`` for it.

        A thread still connecting to a broker that does not answer is left to end on its own (a
        daemon, it closes what it connected once the attempt ends): ``App.close``'s timeout holds.
        """
        self._closing = True
        self._closed.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.add_callback_threadsafe(lambda: None)  # wake it
            except Exception:
                pass
        self._thread.join(timeout=timeout)

    # -- the feed's thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closing:
            try:
                self._follow()
            except (BrokerUnavailable, pika.exceptions.AMQPError, OSError) as exc:
                self._error = str(exc) or type(exc).__name__
                log.warning("state_feed_lost", error=self._error)
            finally:
                self._drop()
            if not self._closing:
                self._closed.wait(_RECONNECT_PAUSE_S)

    def _follow(self) -> None:
        conn = open_blocking(self._settings, connection_name="clockwork-state-feed")
        channel = conn.channel()
        spec = task_states_stream(self._settings.namespace)
        channel.queue_declare(spec.name, **spec.declare_options())
        channel.basic_qos(prefetch_count=_PREFETCH)  # streams need manual acks and a qos
        channel.basic_consume(
            spec.name, self._on_message, auto_ack=False, arguments={"x-stream-offset": self._offset}
        )
        with self._cond:
            self._conn, self._channel, self._error = conn, channel, None
            self._cond.notify_all()
        while not self._closing:
            conn.process_data_events(time_limit=0.2)

    def _drop(self) -> None:
        with self._cond:
            conn, self._conn, self._channel = self._conn, None, None
            self._cond.notify_all()
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception:  # closing a broken connection: nothing left to do
                pass

    def _mark(self, marker: str) -> None:
        channel = self._channel
        if channel is None or not channel.is_open:
            return
        properties = pika.BasicProperties(headers={MARKER_HEADER: marker}, delivery_mode=1)
        channel.basic_publish(
            DEFAULT_EXCHANGE, task_states_stream(self._settings.namespace).name, b"", properties
        )

    def _on_message(
        self,
        channel: BlockingChannel,
        method: pika.spec.Basic.Deliver,
        props: pika.spec.BasicProperties,
        body: bytes,
    ) -> None:
        headers = props.headers or {}
        offset = headers.get("x-stream-offset")
        if isinstance(offset, int):
            self._offset = offset + 1  # a reconnect resumes after the last record read
        marker = headers.get(MARKER_HEADER)
        with self._cond:
            if marker is not None:
                self._seen_markers.add(str(marker))
                self._cond.notify_all()
            else:
                self._index_record(body)
        self._unacked += 1
        if self._unacked >= _ACK_EVERY or marker is not None:
            self._unacked = 0
            channel.basic_ack(method.delivery_tag, multiple=True)

    def _index_record(self, body: bytes) -> None:
        try:
            record = StateRecord.decode(body)
        except MessageError as exc:
            log.debug("state_record_skipped", error=str(exc))
            return
        if self._clock is not None:
            self._clock.adjust(record.clock)
        self._seq += 1
        records = self._index.get(record.task_id)
        if records is None:
            records = self._index[record.task_id] = []
            if len(self._index) > self._max_tasks:
                self._index.popitem(last=False)
        else:
            self._index.move_to_end(record.task_id)
        records.append((self._seq, record))
        if len(records) > _HISTORY_PER_TASK:
            del records[0]
