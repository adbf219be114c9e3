"""The deliveries a consuming child's socket holds unread: looked at, not taken (``inspect reserved``).

With ``--prefetch-multiplier`` above 1 (or ``--threads``) the broker sends a child deliveries
before a consumer asks for them; while its task runs they wait in the kernel's receive buffer,
where the worker's board cannot see them. ``peeked_deliveries`` reads a copy of that buffer
(``MSG_PEEK``) after the bytes the connection has read and not parsed yet, and parses every whole
delivery in it (method, header and body frames). Nothing is consumed: the connection reads them
as usual later. Only a plain socket can be peeked; over TLS the bytes in the kernel are ciphertext.
The kernel holds what its receive buffer does (128 KiB or more): deliveries past that are still
on their way from the broker, and show once the connection has read what is ahead of them.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping

from broker_svc.amqp import frames, methods
from broker_svc.amqp.delivery import TaskDelivery

__all__ = ["peeked_deliveries", "task_delivery"]

_DELIVER = (60, 60)
_RETURN = (60, 50)
_CLOSES = ((10, 50), (20, 40))  # connection.close, channel.close
_PEEK_AT_LEAST = 65_536


def task_delivery(
    deliver: methods.Deliver, properties: frames.Properties, body: bytes, queue: str, generation: int
) -> TaskDelivery:
    """The ``TaskDelivery`` of a basic.deliver, its content header and its body."""
    return TaskDelivery(
        body=body, queue=queue, routing_key=deliver.routing_key, exchange=deliver.exchange,
        redelivered=deliver.redelivered, tag=deliver.delivery_tag, generation=generation,
        content_type=properties.content_type, content_encoding=properties.content_encoding,
        headers=properties.headers or {}, correlation_id=properties.correlation_id,
        reply_to=properties.reply_to, priority=properties.priority, properties=properties,
    )  # fmt: skip


def peeked_deliveries(
    sock: socket.socket, unparsed: bytes, queues: Mapping[str, str], generation: int
) -> list[TaskDelivery] | None:
    """The whole deliveries in ``unparsed`` (read, not parsed yet) followed by what ``sock`` holds;
    None if the broker closed the channel or the connection there (it took back all it delivered).

    Call it only while no other thread reads ``sock``. ``queues`` maps consumer tags to queues.
    A frame cut short at the end (still arriving), a TLS socket or a failed peek end the list early.
    """
    data = bytearray(unparsed)
    if not isinstance(sock, ssl.SSLSocket):
        try:
            size = max(_PEEK_AT_LEAST, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
            data += sock.recv(size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing there (EAGAIN), or a failure the reading thread will meet
            pass
    found: list[TaskDelivery] = []
    try:
        while (frame := frames.next_frame(data)) is not None:
            if frame.type == frames.FRAME_METHOD and frame.method_id in _CLOSES:
                return None
            if frame.type != frames.FRAME_METHOD or frame.method_id not in (_DELIVER, _RETURN):
                continue  # confirms, heartbeats: the connection's, when it reads them
            content = _content(data)
            if content is None:
                break  # cut short: the rest is still arriving
            if frame.method_id == _DELIVER:
                deliver = methods.parse_deliver(frame.payload)
                queue = queues.get(deliver.consumer_tag, deliver.routing_key)
                found.append(task_delivery(deliver, *content, queue, generation))
    except (frames.FrameError, ValueError, IndexError):  # not a sound stream: say what parsed so far
        pass
    return found


def _content(data: bytearray) -> tuple[frames.Properties, bytes] | None:
    # The header and body frames after a deliver (or a return); None if they are not all there.
    header = frames.next_frame(data)
    if header is None or header.type != frames.FRAME_HEADER:
        return None
    properties = frames.decode_properties(header.payload)
    parts, size = [], 0
    while size < properties.body_size:
        body = frames.next_frame(data)
        if body is None or body.type != frames.FRAME_BODY:
            return None
        parts.append(body.payload)
        size += len(body.payload)
    return properties, b"".join(parts)
