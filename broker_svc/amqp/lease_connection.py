"""An election candidate's own connection: consume the election queue, publish tokens, ack them.

The conversation of ``worker/leader/election.py`` with the broker, on one socket read and
written by one thread (the election's keeper), on ``FrameSocket``
(``broker_svc/amqp/frame_socket.py``): the handshake, frames, heartbeats both ways. No pika:
the keeper must see every frame as it comes and never wait on another thread's I/O loop, since the
lease of a leader is renewed by its own tokens coming back.

Any failure is :class:`ConnectionLost` (a ``BrokerUnavailable``): the socket is dropped, what was
delivered goes back to the queue (the broker's), and the keeper connects again as a new candidate.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import time
from typing import Final, NamedTuple

from broker_svc.amqp import frames, methods
from broker_svc.amqp.delivery import ConnectionLost
from broker_svc.amqp.frame_socket import CHANNEL_CLOSE, CONNECTION_CLOSE, FrameSocket, closed_by_broker
from broker_svc.errors import BrokerUnavailable
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_properties, encode_table

__all__ = ["ConnectionLost", "LeaseConnection", "TokenDelivery"]

_CHANNEL: Final = 1
_DELIVER: Final = (60, 60)
_SERVER_CANCEL: Final = (60, 30)
_U64_BIT = struct.Struct(">QB")
_PREFETCH: Final = 100  # bids and a term's tokens: all of them reach the active consumer at once
_WAKE_S: Final = 0.05  # one read waits at most this long: lease deadlines are checked this often


class TokenDelivery(NamedTuple):
    """One message from the election queue: its delivery tag and body."""

    tag: int
    body: bytes


class LeaseConnection(FrameSocket):
    """Consumes one election queue and publishes to it, on the calling thread.

    Args:
        settings: broker URLs (failover order), heartbeat, connect timeout, TLS.
        name: the connection name shown by ``rabbitmqctl list_connections``.
        queue: the election queue (``broker_svc.topology.leader_queue``).
    """

    def __init__(self, settings: Settings, *, name: str, queue: QueueSpec) -> None:
        super().__init__(settings, name=name)
        self._queue = queue
        self._deliveries: collections.deque[TokenDelivery] = collections.deque()
        self._tag = ""
        self.url = ""

    def connect(self) -> None:
        """Connect to the first broker that answers (failover order), declare the queue, consume.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        self.url = redact_url(self._open_first(self._open))

    def _open(self, url: str) -> None:
        tls = self._handshake(url)
        self._deliveries.clear()
        self._expect((20, 11), send=frames.method(_CHANNEL, 20, 10, b"\x00"))
        qos = struct.pack(">IHB", 0, _PREFETCH, 0)
        self._expect((60, 11), send=frames.method(_CHANNEL, 60, 10, qos))
        for answer, frame in methods.declare_frames(_CHANNEL, self._queue):
            self._expect(answer, send=frame)
        consume = (
            b"\x00\x00" + frames.short_string(self._queue.name) + b"\x00" + b"\x00"
            + encode_table({})
        )  # fmt: skip
        ok = self._expect((60, 21), send=frames.method(_CHANNEL, 60, 20, consume))
        self._tag = ok[5 : 5 + ok[4]].decode()
        self._wake(tls)

    def _wake(self, tls: bool) -> None:
        # Reads wake every _WAKE_S: the keeper checks its lease and renewal deadlines between them
        # (FrameSocket's wake of half a heartbeat is too coarse for a lease of a few seconds).
        sock = self._sock
        if sock is None:
            return
        if tls:
            sock.settimeout(_WAKE_S)
        else:
            sock.settimeout(None)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, int(_WAKE_S * 1e6)))

    def next_delivery(self, timeout_s: float) -> TokenDelivery | None:
        """The next message, waiting up to ``timeout_s``; None if none came (heartbeats go out).

        Raises:
            ConnectionLost: the connection failed, the broker closed it or cancelled our consumer,
                or it went silent past two heartbeats.
        """
        deadline = time.monotonic() + timeout_s
        while not self._deliveries:
            if time.monotonic() >= deadline:
                return None
            self._pump()
        return self._deliveries.popleft()

    def ready_count(self) -> int:
        """Messages ready in the queue (not delivered to anyone): a passive declare's count.

        Deliveries that arrive meanwhile are kept for :meth:`next_delivery`.

        Raises:
            ConnectionLost: the connection failed meanwhile.
        """
        declare = b"\x00\x00" + frames.short_string(self._queue.name) + b"\x01" + encode_table({})
        ok = self._expect((50, 11), send=frames.method(_CHANNEL, 50, 10, declare))
        size = ok[4]
        count: int = struct.unpack_from(">I", ok, 5 + size)[0]
        return count

    def publish(self, body: bytes, content_type: str) -> None:
        """Publish ``body`` to the queue (persistent; no confirm: the election waits for the
        message itself to come back, which proves more than a confirm).

        Raises:
            ConnectionLost: the write failed.
        """
        properties = encode_properties(content_type=content_type, delivery_mode=2)
        self._write(frames.publish_frames(
            _CHANNEL, exchange="", routing_key=self._queue.name, mandatory=False, properties=properties,
            body=body, frame_max=self._frame_max,
        ))  # fmt: skip

    def ack(self, tag: int) -> None:
        """Ack one delivery.

        Raises:
            ConnectionLost: the write failed.
        """
        self._write(frames.method(_CHANNEL, 60, 80, _U64_BIT.pack(tag, 0)))

    def close(self) -> None:
        """Close politely (unacked deliveries go back to the queue), then drop the socket."""
        if self._sock is not None:
            with contextlib.suppress(BrokerUnavailable, OSError, frames.FrameError):
                close = frames.method(
                    0, 10, 50, struct.pack(">H", 200) + frames.short_string("bye") + b"\x00" * 4
                )
                self._expect((10, 51), send=close, timeout_s=1.0)
        self.drop()

    def _dispatch(self, frame: frames.Frame) -> None:
        if frame.type != frames.FRAME_METHOD:
            return  # heartbeats
        kind, payload = frame.method_id, frame.payload
        if kind == _DELIVER:
            deliver = methods.parse_deliver(payload)
            _properties, body = self._content()
            self._deliveries.append(TokenDelivery(deliver.delivery_tag, body))
        elif kind == CONNECTION_CLOSE or kind == CHANNEL_CLOSE:
            with contextlib.suppress(BrokerUnavailable):
                self._write(frames.method(frame.channel, kind[0], kind[1] + 1))  # close-ok
            why, _timed_out = closed_by_broker(payload)
            raise self._lost(why)
        elif kind == _SERVER_CANCEL:
            raise self._lost(f"the broker cancelled our consumer of {self._queue.name!r} (deleted?)")
