"""The Clockwork worker: consumes task queues and runs task bodies in a process pool."""

from __future__ import annotations

from worker.config import WorkerConfig
from worker.service import WorkerService

__all__ = ["WorkerConfig", "WorkerService"]
