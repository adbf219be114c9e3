"""The Clockwork worker: a main process supervising a pool of children that consume and run tasks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from worker.config import WorkerConfig
    from worker.service import WorkerService

__all__ = ["WorkerConfig", "WorkerService"]

# Loaded on first use: the pool's forkserver and children import ``worker.child.main`` and what it
# runs only, and would otherwise load the whole service (aio-pika, the control plane, pika) with
# this package, about 15 MiB in each of those processes.
_EXPORTS = {"WorkerConfig": "worker.config", "WorkerService": "worker.service"}


__getattr__ = lazy_exports(__name__, _EXPORTS)
