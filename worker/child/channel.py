"""A pool child's end of its socket to the worker: frames out (ready, tally, answers), orders in."""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

from worker import ipc

__all__ = ["ChildChannel"]


class ChildChannel:
    """This child's end of its socket to the worker; the lock keeps frames from threads apart."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.lock = threading.Lock()

    def send(self, data: bytes) -> None:
        with self.lock:
            self._sock.sendall(data)

    def readable(self) -> bool:
        """Whether a frame (or the end of the socket) is waiting to be read."""
        return bool(select.select([self._sock], [], [], 0)[0])

    def receive(self) -> dict[str, Any] | None:
        header = self._receive_exactly(ipc.HEADER.size)
        body = None if header is None else self._receive_exactly(ipc.frame_length(header))
        return None if body is None else ipc.decode_frame(body)

    def _receive_exactly(self, size: int) -> bytes | None:
        buffer = bytearray(size)
        view, received = memoryview(buffer), 0
        while received < size:
            count = self._sock.recv_into(view[received:])
            if count == 0:
                return None  # the worker closed its end (or died): time to go
            received += count
        return bytes(buffer)
