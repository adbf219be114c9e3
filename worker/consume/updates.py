"""Where a running task's updates go in a consuming child: published by the child itself."""

from __future__ import annotations

import threading
from typing import Any

from worker import ipc
from worker.consume.handle import FeedHandler

__all__ = ["FeedUpdates"]


class FeedUpdates:
    """Where a running task's updates go in a consuming child: published by the child itself.

    Stands where a job-taking child has the worker's socket (``worker.child.run.UpdateSink``).
    """

    def __init__(self, handler: FeedHandler) -> None:
        self.lock = threading.Lock()
        self._handler = handler

    def send(self, data: bytes, *, context: Any = None) -> None:
        with self.lock:
            if context is not None and not context.open:
                raise RuntimeError("the task has already finished; its updates are closed")
            frame = ipc.decode_frame(data[ipc.HEADER.size :])
            payload = frame.get("payload")
            self._handler.update(payload if isinstance(payload, dict) else {})
