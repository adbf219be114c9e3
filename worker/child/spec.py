"""What a consuming pool child is told when it starts: where to connect and what to consume.

Pure and picklable: the pool hands it to each child through the forkserver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec

__all__ = ["FeedSpec"]


@dataclass(frozen=True, slots=True)
class FeedSpec:
    """A consuming child's start-up order.

    Attributes:
        settings: the worker's broker settings (URL, confirm timeout, size limit, accept list).
        queues: the task queues each child consumes.
        queue_specs: how the worker declared them (each with its dead-letter queue, type and
            binding); a child declares them again on each connect before it consumes, so a task
            queue deleted under it is back, exactly as before, when it consumes again.
        prefetch: unacked deliveries per child, or per thread under ``threads`` (1: a busy child
            holds nothing back); with ``prefetch_budget_s``, where the connection starts.
        prefetch_budget_s: the work a child's connection may hold, in seconds of its recent
            tasks (``worker/rules/prefetch_budget.py``); None: ``prefetch`` is fixed.
        hostname: the worker's node name, for ``task.request.hostname`` and the connection name.
        default_time_limits: the worker's ``(hard, soft)`` time limits, None for none.
        revoked: the ids revoked when the child starts; later ones come over its socket.
        board_path: the worker's shared board of running tasks (``worker/shared/board.py``).
        board_slots: how many slots the board has.
        slot: this child's slot on it.
        task_names: every task the app registers, sorted (the rate buckets' order).
        async_task_names: those whose body is ``async def``: under ``--threads`` a terminate
            cancels such a task in its thread instead of ending the child.
        rate_limits: tokens per second of each rate-limited task, shared by the children.
        rates_path: the file of their buckets (``worker/shared/rates.py``).
        task_events: send ``task-*`` events from the start (``-E``).
        max_tasks_per_child: a child retires after this many tasks (None: never).
        max_memory_per_child_kib: a child retires once its resident memory passed this after a task.
        threads: task threads per child (``--threads``), sharing one connection whose prefetch is
            ``prefetch * threads``; the child's board slots are ``slot * threads`` to
            ``slot * threads + threads - 1``.
        dedupe_window_s: ``--dedupe-window``: skip a task id the worker runs or finished this recently.
        dedupe_path: the worker's dedupe window, shared by the children (``worker/shared/dedupe.py``).
        done_path: the worker's table of outcomes whose ack was lost (``worker/child/redeliveries.py``).
    """

    settings: Settings
    queues: tuple[str, ...]
    prefetch: int
    hostname: str
    queue_specs: tuple[QueueSpec, ...] = ()
    default_time_limits: tuple[float | None, float | None] = (None, None)
    revoked: tuple[str, ...] = ()
    board_path: str | None = None
    board_slots: int = 0
    slot: int = 0
    task_names: tuple[str, ...] = ()
    async_task_names: tuple[str, ...] = ()
    rate_limits: dict[str, float] = field(default_factory=dict)
    rates_path: str | None = None
    task_events: bool = False
    max_tasks_per_child: int | None = None
    max_memory_per_child_kib: int | None = None
    threads: int = 1
    dedupe_window_s: float | None = None
    dedupe_path: str | None = None
    done_path: str | None = None
    prefetch_budget_s: float | None = None

    @property
    def connection_prefetch(self) -> int:
        """The prefetch of a child's one connection: ``prefetch`` for each of its threads."""
        return self.prefetch * self.threads

    def connection_name(self, pid: int) -> str:
        """The name the broker lists for the connection of child ``pid``."""
        return f"{self.hostname}.child-{pid}"
