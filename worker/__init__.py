"""The Clockwork worker: consumes task queues and runs task bodies in a process pool."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.service import WorkerService

__all__ = ["WorkerConfig", "WorkerService"]

# Loaded on first use: the pool's forkserver and children import ``worker.child`` and ``worker.ipc``
# only, and would otherwise load the whole service (aio-pika, the control plane, pika) with this
# package, about 15 MiB in each of those processes.
_EXPORTS = {"WorkerConfig": "worker.config", "WorkerService": "worker.service"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'worker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
