"""The socket under a consuming child's connection: AMQP frames read and written, heartbeats, a close.

``FrameSocket`` is what ``FeedConnection`` (``broker_svc/amqp/feed_connection.py``) stands on:
the TCP (or TLS) socket and the AMQP handshake, one whole frame read at a time (a kernel receive
timeout wakes a read so heartbeats go out), writes under a lock, and the heartbeat thread that
keeps the connection alive while a task runs and peeks for a close the broker sent meanwhile. What
the frames mean (deliveries, confirms, returns) is the connection's: it implements ``_dispatch``.

Threads. The child's main thread reads and writes while no task runs. While one does
(:meth:`FrameSocket.running`), the heartbeat thread writes, and the hard time limit's watchdog may
take the socket over (:meth:`FrameSocket.taken_over`); the lock gives the socket to one at a time.
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Final
from urllib.parse import unquote, urlsplit

from broker_svc.amqp import frames, methods
from broker_svc.amqp.delivery import ConnectionLost
from broker_svc.errors import BrokerUnavailable
from broker_svc.settings import Settings, redact_url

__all__ = ["CHANNEL_CLOSE", "CONNECTION_CLOSE", "FRAME_MAX", "FrameSocket", "closed_by_broker"]

READ_SIZE: Final = 65_536  # bytes per socket read at most (a small task's delivery is one read)
FRAME_MAX: Final = 131_072
_PEEK_EVERY_S: Final = 1.0  # while a task runs, how often arrived frames are looked at for a close
CONNECTION_CLOSE: Final = (10, 50)
CHANNEL_CLOSE: Final = (20, 40)


class FrameSocket:
    """One AMQP connection's socket and frames; the subclass gives the frames their meaning.

    Args:
        settings: heartbeat, timeouts, TLS, the virtual host.
        name: the connection name shown by ``rabbitmqctl list_connections``.
    """

    def __init__(self, settings: Settings, *, name: str) -> None:
        self._settings = settings
        self._name = name
        # Whoever writes to (or, while a task runs, reads) the socket; reentrant, as the hard time
        # limit's watchdog holds it across the publish and the ack it sends.
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        # One read buffer for the connection's life: ``recv(256 KiB)`` allocated and freed a quarter
        # megabyte per read, and a small task at prefetch 1 takes a read or two.
        self._scratch = memoryview(bytearray(READ_SIZE))
        self._frame_max = FRAME_MAX
        self._heartbeat_s = 0
        self._last_write = self._last_read = 0.0
        self._busy = False
        self._running = _Busy(self)  # one for every task: it holds no state of its own
        self._beating = threading.Event()
        # Told (from the heartbeat thread) when the broker closes the connection or channel while a
        # task runs, so it is logged when it happens, not when the task ends (plain sockets).
        self.on_close_seen: Callable[[ConnectionLost], None] | None = None
        self._close_seen = False

    def _dispatch(self, frame: frames.Frame) -> None:
        """Handle one frame that nobody waits for (the subclass's)."""
        raise NotImplementedError

    # -- opening -----------------------------------------------------------------------------------

    def _handshake(self, url: str) -> bool:
        """Connect to ``url`` and open the AMQP connection (no channel yet); whether it is TLS."""
        settings = self._settings
        parts = urlsplit(url)
        tls = settings.tls_context(url)
        host = parts.hostname or "localhost"
        sock = socket.create_connection(
            (host, parts.port or (5671 if tls else 5672)), settings.connect_timeout_s
        )
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        self._sock, self._buffer = sock, bytearray()
        self._close_seen = False
        self._last_read = time.monotonic()
        self._write(b"AMQP\x00\x00\x09\x01")
        self._expect((10, 10))  # connection.start: PLAIN is always offered
        user, password = unquote(parts.username or "guest"), unquote(parts.password or "guest")
        self._write(methods.start_ok(self._name, user, password))
        tune = self._expect((10, 30))
        _channels, frame_max, server_heartbeat = struct.unpack_from(">HIH", tune, 4)
        ours = settings.heartbeat_s
        self._heartbeat_s = (
            min(ours, server_heartbeat) if ours and server_heartbeat else max(ours, server_heartbeat)
        )
        self._frame_max = min(frame_max or FRAME_MAX, FRAME_MAX)
        self._write(methods.tune_ok(self._frame_max, self._heartbeat_s))
        self._write(methods.connection_open(settings.virtual_host))
        self._expect((10, 41))
        return tls is not None

    def _open_first(self, open_url: Callable[[str], None]) -> str:
        """Drop the socket, then ``open_url`` each broker URL in failover order until one opens.

        Returns:
            The URL that opened.

        Raises:
            BrokerUnavailable: none did (each URL's reason named).
        """
        self.drop()
        failures = []
        for url in self._settings.broker_urls:
            try:
                open_url(url)
            except (OSError, frames.FrameError, BrokerUnavailable) as exc:
                self.drop()
                failures.append(f"{redact_url(url)}: {exc}")
                continue
            return url
        raise BrokerUnavailable("; ".join(failures))

    def _set_wake(self, tls: bool) -> None:
        # One read waits at most this long, so heartbeats go out and a stop is seen. A kernel receive
        # timeout on a blocking socket costs one system call per read; Python's own timeout adds a
        # poll() before each (TLS keeps it: its reads cannot use the kernel's).
        sock = self._sock
        if sock is None:
            return
        wake = min(0.5, self._heartbeat_s / 2) if self._heartbeat_s else 0.5
        if not tls:
            sock.settimeout(None)
            seconds = int(wake)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, int((wake - seconds) * 1e6))
            )
        else:
            sock.settimeout(wake)

    def _start_beating(self) -> None:
        # The heartbeat thread, once per connection object (it outlives reconnects).
        if not self._heartbeat_s or self._beating.is_set():
            return
        self._beating.set()
        beat = threading.Thread(target=self._beat, name=f"clockwork-beat-{self._name}", daemon=True)
        # Started with every signal blocked: the caller's signals (a task's SIGALRM) stay its own.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        try:
            beat.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    # -- the socket --------------------------------------------------------------------------------

    def running(self) -> AbstractContextManager[None]:
        """While the body runs: the heartbeat thread keeps the connection alive."""
        return self._running

    def _set_busy(self, busy: bool) -> None:
        with self._lock:
            self._busy = busy

    @contextlib.contextmanager
    def taken_over(self) -> Iterator[None]:
        """For another thread while a task runs (the hard time limit): the socket is its alone."""
        with self._lock:
            self._busy = False  # nothing else writes now; this thread reads and writes
            yield

    def drop(self) -> None:
        """Drop the socket without a word (after a failure)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def loss_to_tell(self, exc: BrokerUnavailable) -> BrokerUnavailable | None:
        """The failure to log for ``exc`` (None: logged already); with one thread, ``exc`` itself."""
        return exc

    def _lost(
        self, why: str, *, consumer_timeout: bool = False, cancelled_queue: str | None = None
    ) -> ConnectionLost:
        message = f"connection {self._name}: {why}"
        lost = ConnectionLost(message, consumer_timeout=consumer_timeout, cancelled_queue=cancelled_queue)
        lost.reported = self._close_seen
        self._losing(lost)
        self.drop()
        return lost

    def _losing(self, lost: ConnectionLost) -> None:
        """Told of a failure just before the socket is dropped (which wakes any other thread)."""

    def _write(self, data: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        try:
            with self._lock:
                sock.sendall(data)
                self._last_write = time.monotonic()
        except OSError as exc:
            if self._sock is not sock:  # another thread connected again (--threads): not ours to drop
                # The thread that connected again saw the loss, and told it.
                raise ConnectionLost(f"connection {self._name}: write failed: {exc}", reported=True) from exc
            raise self._lost(f"write failed: {exc}") from exc

    def _expect(
        self, wanted: tuple[int, int], *, send: bytes | None = None, timeout_s: float | None = None
    ) -> bytes:
        # Send ``send`` (if any) and read until the method ``wanted`` arrives; its payload.
        if send is not None:
            self._write(send)
        deadline = time.monotonic() + (timeout_s or self._settings.connect_timeout_s * 2)
        while True:
            if time.monotonic() >= deadline:
                raise self._lost(f"no answer to {wanted} in time")
            frame = self._read()
            if frame is None:
                continue
            if frame.type == frames.FRAME_METHOD and frame.method_id == wanted:
                return frame.payload
            self._dispatch(frame)

    def _read_arrived(self) -> None:
        # Handle the frames already received, without waiting for more. A plain socket is read
        # without blocking (one system call, where a select() then a read took two), and a read
        # that did not fill the scratch buffer took all there was: no second look.
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        drained = False
        while True:
            frame = frames.next_frame(self._buffer)
            if frame is None:
                if drained:
                    return
                if isinstance(sock, ssl.SSLSocket):
                    if not sock.pending() and not select.select([sock], [], [], 0)[0]:
                        return
                    frame = self._read()
                    if frame is None:
                        return
                else:
                    size = self._receive(sock, socket.MSG_DONTWAIT)
                    drained = size is None or size < READ_SIZE
                    continue
            self._dispatch(frame)

    def _receive(self, sock: socket.socket, flags: int = 0) -> int | None:
        # One read into the buffer: its size, or None if nothing came (within the wake interval, or
        # at once with MSG_DONTWAIT).
        try:
            size = sock.recv_into(self._scratch, READ_SIZE, flags)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError as exc:
            raise self._lost(f"read failed: {exc}") from exc
        if not size:
            raise self._lost("the broker closed the connection")
        self._last_read = time.monotonic()
        self._buffer += self._scratch[:size]
        return size

    def _pump(self) -> None:
        # Read (one wait of at most the wake interval) and handle a frame; heartbeats both ways.
        frame = self._read()
        if frame is not None:
            self._dispatch(frame)
        if self._heartbeat_s:
            now = time.monotonic()
            if now - self._last_write >= self._heartbeat_s / 2:
                self._write(frames.HEARTBEAT)
            if frame is None and now - self._last_read > 2 * self._heartbeat_s:
                raise self._lost(f"no heartbeat from the broker in {2 * self._heartbeat_s} s")

    def _read(self) -> frames.Frame | None:
        # One whole frame, or None if none came within the wake interval.
        frame = frames.next_frame(self._buffer)
        if frame is not None:
            return frame
        sock = self._sock
        if sock is None:
            raise ConnectionLost("not connected")
        if self._receive(sock) is None:
            return None
        return frames.next_frame(self._buffer)

    def _content(self) -> tuple[frames.Properties, bytes]:
        # The header and body frames that follow a deliver or a return.
        header = self._next_frame()
        if header.type != frames.FRAME_HEADER:
            raise self._lost("a content header was expected")
        properties = frames.decode_properties(header.payload)
        parts, size = [], 0
        while size < properties.body_size:
            body = self._next_frame()
            if body.type != frames.FRAME_BODY:
                raise self._lost("a content body was expected")
            parts.append(body.payload)
            size += len(body.payload)
        return properties, b"".join(parts)

    def _next_frame(self) -> frames.Frame:
        deadline = time.monotonic() + self._settings.connect_timeout_s
        while (frame := self._read()) is None:
            if time.monotonic() >= deadline:
                raise self._lost("a frame was cut short")
        return frame

    def _beat(self) -> None:
        # While a task runs, nobody else writes: a heartbeat every half interval keeps us alive, and
        # a look at what arrived each second tells a close when it comes.
        while self._beating.is_set():
            time.sleep(max(min(self._heartbeat_s / 2, _PEEK_EVERY_S), 0.05))
            with self._lock:
                sock = self._sock
                if not self._busy or sock is None:
                    continue
                if time.monotonic() - self._last_write >= self._heartbeat_s / 2:
                    try:
                        sock.sendall(frames.HEARTBEAT)
                        self._last_write = time.monotonic()
                    except OSError:
                        continue  # the main thread finds out on its next read
                if not self._close_seen and not isinstance(sock, ssl.SSLSocket):
                    self._peek_close(sock)

    def _peek_close(self, sock: socket.socket) -> None:
        # Look at what arrived without taking it (the main thread reads it once the task ends): a
        # close there is told now. Best effort: only what one peek holds is seen.
        try:
            pending = bytearray(self._buffer) + sock.recv(READ_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing came (EAGAIN), or the main thread finds out
            return
        with contextlib.suppress(frames.FrameError):  # the main thread finds out
            while (frame := frames.next_frame(pending)) is not None:
                if frame.type == frames.FRAME_METHOD and frame.method_id in (
                    CONNECTION_CLOSE,
                    CHANNEL_CLOSE,
                ):
                    why, timed_out = closed_by_broker(frame.payload)
                    self._close_seen = True
                    if self.on_close_seen is not None and self._first_to_tell():
                        message = f"connection {self._name}: {why} (while a task runs)"
                        self.on_close_seen(ConnectionLost(message, consumer_timeout=timed_out))
                    return

    def _first_to_tell(self) -> bool:
        """Whether a close seen by a peek is the first word of this connection's loss (the
        subclass's, where threads may tell it too)."""
        return True


def closed_by_broker(payload: bytes) -> tuple[str, bool]:
    # Why, and whether it is RabbitMQ's close for a delivery held past consumer_timeout (406
    # PRECONDITION_FAILED "... timed out").
    code, text = methods.close_reason(payload)
    return f"closed by the broker: {code} {text}", code == 406 and "timed out" in text


class _Busy:
    # FrameSocket.running's: a class, not a generator, as it is entered once per task; one per socket.
    __slots__ = ("_socket",)

    def __init__(self, socket: FrameSocket) -> None:
        self._socket = socket

    def __enter__(self) -> None:
        self._socket._set_busy(True)

    def __exit__(self, *exc: object) -> None:
        self._socket._set_busy(False)
