"""What a worker holds right now, and how ``inspect`` shows it (Celery's TASK_INFO shapes).

Pure bookkeeping: the consumer records each delivery as it moves from *scheduled* (ETA held in
memory) or *reserved* (waiting for a free child) to *active* (running in a child), and the
control commands read the views.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker_svc.wire.task_message import TaskMessage, safe_repr
from worker.pool.board import Running

__all__ = ["Tracked", "WorkerState"]


@dataclass(slots=True)
class Tracked:
    """One delivery: its request, delivery info and, once running, when it started."""

    request: TaskMessage
    delivery: dict[str, Any]
    time_start: float | None = None


class WorkerState:
    """Deliveries by where they are: scheduled, reserved, active.

    Args:
        hostname: this node (TASK_INFO's ``hostname``).
        pids: returns ``{task_id: child pid}`` of running tasks.
    """

    def __init__(
        self,
        hostname: str,
        pids: Callable[[], dict[str, int]],
        board: Callable[[], list[Running]] | None = None,
    ) -> None:
        self._hostname = hostname
        self._pids = pids
        self._board = board  # what consuming children run (--children-consume)
        self.scheduled_tasks: dict[str, Tracked] = {}
        self.reserved_tasks: dict[str, Tracked] = {}
        self.active_tasks: dict[str, Tracked] = {}

    def start(self, tracked: Tracked) -> None:
        """The delivery went to a child."""
        tracked.time_start = time.time()
        self.active_tasks[tracked.request.id] = tracked

    def running(self, task_id: str) -> TaskMessage | None:
        """The request of a running task, if it runs here."""
        tracked = self.active_tasks.get(task_id)
        return tracked.request if tracked else None

    def active(self, *, safe: bool = False) -> list[dict[str, Any]]:
        """TASK_INFO of every running task (inspect ``active``)."""
        pids = self._pids()
        here = [self.info(t, safe=safe, pid=pids.get(t.request.id)) for t in list(self.active_tasks.values())]
        return here + [self._board_info(entry, safe=safe) for entry in self._board()] if self._board else here

    @property
    def running_count(self) -> int:
        """How many tasks run now."""
        return len(self.active_tasks) + (len(self._board()) if self._board else 0)

    def _board_info(self, entry: Running, *, safe: bool) -> dict[str, Any]:
        # A task a consuming child runs (its board slot) or holds unstarted (``started`` 0).
        info = entry.info
        return {
            "id": info.get("id"),
            "name": info.get("name"),
            "args": safe_repr(info.get("args")) if safe else info.get("args"),
            "kwargs": safe_repr(info.get("kwargs")) if safe else info.get("kwargs"),
            "type": info.get("type"),
            "hostname": self._hostname,
            "time_start": entry.started or None,
            "acknowledged": False,
            "delivery_info": info.get("delivery_info"),
            "worker_pid": entry.pid,
        }

    def reserved(self, *, safe: bool = False, held: Sequence[Running] = ()) -> list[dict[str, Any]]:
        """TASK_INFO of deliveries waiting for a free child (inspect ``reserved``); ``held``: those
        consuming children hold unstarted (``Feeding.held``)."""
        here = [self.info(t, safe=safe) for t in list(self.reserved_tasks.values())]
        return here + [self._board_info(entry, safe=safe) for entry in held]

    def scheduled(self, *, safe: bool = False) -> list[dict[str, Any]]:
        """ETA tasks held in memory (inspect ``scheduled``).

        Tasks due later wait in the broker's delay queues, not here (docs/design.md, ETA).
        """
        return [
            {"eta": t.request.eta.isoformat() if t.request.eta else None, "priority": t.request.priority or 0,
             "request": self.info(t, safe=safe)}
            for t in list(self.scheduled_tasks.values())
        ]  # fmt: skip

    def query(self, task_ids: list[str], *, held: Sequence[Running] = ()) -> dict[str, list[Any]]:
        """Where each known id is: ``{id: [state, TASK_INFO]}`` (inspect ``query_task``)."""
        found: dict[str, list[Any]] = {}
        wanted = set(task_ids)
        for state, infos in (
            ("active", self.active()),
            ("reserved", self.reserved(held=held)),
            ("reserved", [s["request"] for s in self.scheduled()]),
        ):
            for info in infos:
                if info["id"] in wanted and info["id"] not in found:
                    found[info["id"]] = [state, info]
        return found

    def info(self, tracked: Tracked, *, safe: bool, pid: int | None = None) -> dict[str, Any]:
        """Celery's TASK_INFO (``Request.info``) of one delivery."""
        request = tracked.request
        return {
            "id": request.id,
            "name": request.display_name,
            "args": safe_repr(request.args) if safe else request.args,
            "kwargs": safe_repr(request.kwargs) if safe else request.kwargs,
            "type": request.task,
            "hostname": self._hostname,
            "time_start": tracked.time_start,
            "acknowledged": False,  # we ack after the task ran
            "delivery_info": tracked.delivery,
            "worker_pid": pid,
        }
