"""What a consuming pool child is told when it starts: where to connect and what to consume.

Pure and picklable: the pool hands it to each child through the forkserver.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker_svc.settings import Settings

__all__ = ["FeedSpec"]


@dataclass(frozen=True, slots=True)
class FeedSpec:
    """A consuming child's start-up order.

    Attributes:
        settings: the worker's broker settings (URL, confirm timeout, size limit, accept list).
        queues: the task queues each child consumes.
        prefetch: unacked deliveries per child (1: a busy child holds nothing back).
        hostname: the worker's node name, for ``task.request.hostname`` and the connection name.
        default_time_limits: the worker's ``(hard, soft)`` time limits, None for none.
        revoked: the ids revoked when the child starts; later ones come over its socket.
        namespace: the control namespace (it names the chord joiner's queue).
        board_path: the worker's shared board of running tasks (``worker/pool/board.py``).
        board_slots: how many slots the board has.
        slot: this child's slot on it.
        task_names: every task the app registers, sorted (the rate buckets' order).
        rate_limits: tokens per second of each rate-limited task, shared by the children.
        rates_path: the file of their buckets (``worker/feed/rates.py``).
        task_events: send ``task-*`` events from the start (``-E``).
        max_tasks_per_child: a child retires after this many tasks (None: never).
        max_memory_per_child_kib: a child retires once its resident memory passed this after a task.
    """

    settings: Settings
    queues: tuple[str, ...]
    prefetch: int
    hostname: str
    default_time_limits: tuple[float | None, float | None] = (None, None)
    revoked: tuple[str, ...] = ()
    namespace: str = "celery"
    board_path: str | None = None
    board_slots: int = 0
    slot: int = 0
    task_names: tuple[str, ...] = ()
    rate_limits: dict[str, float] = field(default_factory=dict)
    rates_path: str | None = None
    task_events: bool = False
    max_tasks_per_child: int | None = None
    max_memory_per_child_kib: int | None = None
