"""An election candidate's own connection: consume the election queue, publish tokens, ack them.

The conversation of ``worker/leader/election.py`` with the broker, on one socket read and
written by one thread (the election's keeper): the ``Channel`` core (``broker_svc/amqp/channel.py``:
channel, qos, declare, consume, publish frames, ack, the close handshakes, what the broker sends
unasked) on ``FrameSocket``'s handshake, frames and heartbeats. No pika: the keeper must see
every frame as it comes and never wait on another thread's I/O loop, since the lease of a
leader is renewed by its own tokens coming back.

Any failure is :class:`ConnectionLost` (a ``BrokerUnavailable``): the socket is dropped, what was
delivered goes back to the queue (the broker's), and the keeper connects again as a new candidate.
"""

from __future__ import annotations

import collections
import socket
import struct
import time
from typing import Final, NamedTuple

from broker_svc.amqp import frames, methods
from broker_svc.amqp.channel import CHANNEL, Channel
from broker_svc.amqp.delivery import ConnectionLost
from broker_svc.settings import Settings, redact_url
from broker_svc.topology import QueueSpec
from broker_svc.wire.amqp_fields import encode_properties, encode_table

__all__ = ["ConnectionLost", "LeaseConnection", "TokenDelivery"]

_PREFETCH: Final = 100  # bids and a term's tokens: all of them reach the active consumer at once
_WAKE_S: Final = 0.05  # one read waits at most this long: lease deadlines are checked this often


class TokenDelivery(NamedTuple):
    """One message from the election queue: its delivery tag and body."""

    tag: int
    body: bytes


class LeaseConnection(Channel):
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
        self.url = ""

    def connect(self) -> None:
        """Connect to the first broker that answers (failover order), declare the queue, consume.

        Raises:
            BrokerUnavailable: no broker could be reached or none let us in (each reason named).
        """
        self.url = redact_url(self._open_first(self._open))

    def _open(self, url: str) -> None:
        self.generation += 1
        tls = self._handshake(url)
        self._deliveries.clear()
        self._open_channel(confirms=False)  # the tokens coming back prove more than a confirm
        self._qos(_PREFETCH)
        self._declare(self._queue)
        self._subscribe(self._queue.name)
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
        ok = self._expect((50, 11), send=frames.method(CHANNEL, 50, 10, declare))
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
        self._write(self._content_frames(properties, body, self._queue.name, exchange="", mandatory=False))

    def ack(self, tag: int) -> None:
        """Ack one delivery.

        Raises:
            ConnectionLost: the write failed.
        """
        self._write(self._ack_frame(tag))

    def _on_deliver(self, payload: bytes) -> None:
        deliver = methods.parse_deliver(payload)
        _properties, body = self._content()
        self._deliveries.append(TokenDelivery(deliver.delivery_tag, body))
