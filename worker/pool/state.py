"""What a worker's children run and hold right now, as ``inspect`` shows it (Celery's TASK_INFO shapes).

The children consume for themselves, so the main process holds no delivery: what they run is on
the shared board (``worker/shared/board.py``), read without asking; what they hold and have not
started is asked of them when an operator asks (``Feeding.held``) and shown here. Tasks due later wait in the
broker's delay queues, not in a worker (docs/design.md, ETA): ``scheduled`` lists those this worker
parked, from their records (``worker/remote/scheduled.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from broker_svc.wire.task.task_message import safe_repr
from worker.pool.feeding import Feeding
from worker.shared.board import Running

__all__ = ["ParkedTasks", "WorkerState"]


class ParkedTasks(Protocol):
    """The ETA tasks this worker parked (``worker/remote/scheduled.py:ScheduledLog``)."""

    def listed(self) -> list[dict[str, Any]]: ...

    def find(self, task_id: str) -> dict[str, Any] | None: ...


class WorkerState:
    """The children's tasks by where they are: running (active) or held unstarted (reserved).

    Args:
        hostname: this node (TASK_INFO's ``hostname``).
        feeding: the pool's side of its children (the board, their answers).
        parked: the tasks parked in the delay queues, by their records (None: none listed).
    """

    def __init__(self, hostname: str, feeding: Feeding, parked: ParkedTasks | None = None) -> None:
        self._hostname = hostname
        self._feeding = feeding
        self._parked = parked

    def active(self, *, safe: bool = False) -> list[dict[str, Any]]:
        """TASK_INFO of every running task (inspect ``active``)."""
        return [self._info(entry, safe=safe) for entry in self._feeding.running()]

    @property
    def running_count(self) -> int:
        """How many tasks run now."""
        return len(self._feeding.running())

    def reserved(self, held: Sequence[Running], *, safe: bool = False) -> list[dict[str, Any]]:
        """TASK_INFO of what the children hold and have not started (inspect ``reserved``).

        Args:
            held: their answers to ``Feeding.held``.
            safe: arguments as reprs.
        """
        return [self._info(entry, safe=safe) for entry in held]

    def scheduled(self) -> list[dict[str, Any]]:
        """The ETA tasks this worker parked in the delay queues, not yet due (inspect ``scheduled``)."""
        return self._parked.listed() if self._parked is not None else []

    def query(self, task_ids: list[str], held: Sequence[Running]) -> dict[str, list[Any]]:
        """Where each known id is: ``{id: [state, TASK_INFO]}`` (inspect ``query_task``)."""
        found: dict[str, list[Any]] = {}
        wanted = set(task_ids)
        for state, infos in (("active", self.active()), ("reserved", self.reserved(held))):
            for info in infos:
                if info["id"] in wanted and info["id"] not in found:
                    found[info["id"]] = [state, info]
        if self._parked is not None:
            for task_id in wanted - found.keys():
                if (parked := self._parked.find(task_id)) is not None:
                    found[task_id] = ["scheduled", parked]
        return found

    def _info(self, entry: Running, *, safe: bool) -> dict[str, Any]:
        # A task a child runs (its board slot) or holds unstarted (``started`` 0).
        info = entry.info
        return {
            "id": info.get("id"),
            "name": info.get("name"),
            "args": safe_repr(info.get("args")) if safe else info.get("args"),
            "kwargs": safe_repr(info.get("kwargs")) if safe else info.get("kwargs"),
            "type": info.get("type"),
            "hostname": self._hostname,
            "time_start": entry.started or None,
            "acknowledged": False,  # we ack after the task ran
            "delivery_info": info.get("delivery_info"),
            "worker_pid": entry.pid,
        }
