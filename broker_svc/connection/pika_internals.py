"""Every private pika name Clockwork relies on, each behind a small named class or function.

- ``GatheringConnection`` overrides ``Connection._output_marshaled_frames`` and calls
  ``_adapter_emit_data``: fewer socket writes, one per message, one per gathered batch. It also
  sends straight to a plaintext transport's socket (``_transport``, ``_sock``, ``_state``) when
  nothing is buffered ahead.
- ``abort_connection`` calls ``_adapter_disconnect_stream``: drop the socket without a close-ok.
- ``release_while_polling`` swaps the ``select.epoll`` (or ``select.poll``) object of the I/O loop's
  poller (``IOLoop._poller``, its ``_create_poller`` and ``_poll``) for one whose wait releases a lock.
- ``EncodedProperties`` gives pika's content header (``frame.Header.marshal``) properties encoded
  already, through the ``INDEX`` and ``encode()`` it reads.
- ``underlying_channel`` reaches ``BlockingChannel._impl``, the channel under the blocking wrapper.

``tests/unit/test_private_internals.py`` pins each of them (pika 1.x); the version range in
``pyproject.toml`` is the one those tests ran against.

Gathering: pika hands each frame to its transport on its own (a message is three: method, header, body) and
the transport sends each with a ``send()`` of its own, which releases and retakes the GIL that the
caller's thread wants too. When enqueueing, those sends were the larger part of the I/O thread's
time. Here a message's frames go out as one buffer, and the frames marshaled inside
``gathered()`` (a drain of the outbox) as one buffer per ``_GATHER_BYTES``.

Sending at once: pika's transport only buffers a write and asks the loop to watch for writability
(an ``epoll_ctl``), sends on the loop's next turn (an ``epoll_wait``), then stops watching (another
``epoll_ctl``). For a call whose caller waits on the reply, that turn was 10-30 µs of the round
trip (of 0.7-0.9 ms on loopback). With nothing buffered ahead, the socket takes the bytes now;
what it does not take (a full send buffer) and any error go to pika's transport, which sends the
rest in order or reports the error as usual. TLS keeps pika's path: an SSL socket's partial
writes have rules of their own.

The integration tests publish through it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final

import pika
import pika.channel
from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport

__all__ = [
    "EncodedProperties",
    "GatheringConnection",
    "abort_connection",
    "release_while_polling",
    "underlying_channel",
]

# A gathered batch goes to the transport whenever it reaches this size, so a drain of thousands of
# messages never builds one buffer of megabytes.
_GATHER_BYTES: Final = 128 * 1024


class GatheringConnection(pika.SelectConnection):  # type: ignore[misc]  # pika is untyped here
    """A ``SelectConnection`` whose writes are joined (see the module's docstring)."""

    _gathered: list[bytes] | None = None
    _gathered_bytes = 0

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Frames marshaled inside go out together when it ends (or every ``_GATHER_BYTES``)."""
        if self._gathered is not None:  # nested: the outer one flushes
            yield
            return
        self._gathered = []
        try:
            yield
        finally:
            self._flush_gathered()
            self._gathered = None

    def _output_marshaled_frames(self, marshaled_frames: Sequence[bytes]) -> None:
        data = marshaled_frames[0] if len(marshaled_frames) == 1 else b"".join(marshaled_frames)
        # pika's own bookkeeping (its heartbeat checker reads bytes_sent).
        self.bytes_sent += len(data)
        self.frames_sent += len(marshaled_frames)
        gathered = self._gathered
        if gathered is None:
            self._emit(data)
            return
        gathered.append(data)
        self._gathered_bytes += len(data)
        if self._gathered_bytes >= _GATHER_BYTES:
            self._flush_gathered()

    def _flush_gathered(self) -> None:
        parts, self._gathered = self._gathered, []
        self._gathered_bytes = 0
        # Marshaled frames of a connection that closed meanwhile are dropped, as pika drops what
        # its transport still buffered; unconfirmed messages are sent again on the next connection.
        if parts and not self.is_closed:
            self._emit(b"".join(parts))

    def _emit(self, data: bytes) -> None:
        # Straight to the socket if nothing is buffered ahead (see the module's docstring).
        transport = self._transport
        if (
            type(transport) is _AsyncPlaintextTransport
            and transport._state == transport._STATE_ACTIVE
            and transport.get_write_buffer_size() == 0
        ):
            try:
                sent: int = transport._sock.send(data)
            except OSError:  # EAGAIN, or an error pika's own send meets again and reports
                sent = 0
            if sent == len(data):
                return
            data = data[sent:]
        self._adapter_emit_data(data)


def abort_connection(conn: pika.SelectConnection) -> None:
    """Drop ``conn``'s socket at once; pika reports it to ``on_close_callback`` as a lost connection.

    pika's own abort (``_adapter_disconnect_stream``): ``close()`` waits for the broker's close-ok,
    which a frozen or partitioned broker never sends.
    """
    conn._adapter_disconnect_stream()


def release_while_polling(conn: pika.SelectConnection, lock: threading.Lock) -> bool:
    """Have ``conn``'s I/O loop, run by a thread holding ``lock``, release it while it waits for events.

    Then whoever takes ``lock`` may use the connection while the loop waits (between its waits, the
    loop's thread holds it). Call it before the loop starts (it makes its poller then). Returns
    False, changing nothing, for a poller without a poll object (``select.select``'s): then
    ``lock`` stays held while the loop runs, and nobody else gets it.
    """
    poller: Any = getattr(conn.ioloop, "_poller", None)
    create = getattr(poller, "_create_poller", None)
    if poller is None or create is None or getattr(poller, "_poll", True) is not None:
        return False
    poller._create_poller = lambda: _PollReleasing(create(), lock)
    return True


class _PollReleasing:
    """A ``select.epoll``/``select.poll`` object whose ``poll`` releases ``lock`` while it waits."""

    __slots__ = ("_lock", "_poll")

    def __init__(self, poll: Any, lock: threading.Lock) -> None:
        self._poll, self._lock = poll, lock

    def poll(self, timeout: float) -> Any:
        self._lock.release()
        try:
            return self._poll.poll(timeout)
        finally:
            self._lock.acquire()

    def register(self, fd: int, events: int) -> None:
        self._poll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        self._poll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        self._poll.unregister(fd)

    def close(self) -> None:
        close = getattr(self._poll, "close", None)  # select.poll has none
        if close is not None:
            close()


class EncodedProperties(pika.BasicProperties):  # type: ignore[misc]  # pika is untyped here
    """Properties encoded already (``broker_svc.wire.amqp_fields``): what pika's content header takes
    from its properties is ``INDEX`` and ``encode()``, and only this is given."""

    def __init__(self, encoded: bytes) -> None:  # no super().__init__: there are no fields to set
        self._encoded = encoded

    def encode(self) -> list[bytes]:
        return [self._encoded]

    def __repr__(self) -> str:
        return f"<EncodedProperties {len(self._encoded)} bytes>"


def underlying_channel(channel: Any) -> pika.channel.Channel | None:
    """The ``pika.channel.Channel`` under a ``BlockingChannel`` (its ``_impl``); None if it has none.

    Closing it directly drops the deliveries the blocking wrapper holds instead of rejecting them.
    """
    impl: pika.channel.Channel | None = getattr(channel, "_impl", None)
    return impl
