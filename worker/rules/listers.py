"""Which live worker lists a task our client parked itself, in ``inspect scheduled`` (pure).

A client sends an ETA task straight to a delay queue and records the park with no worker's name
(``broker_svc/wire/records/parked.py``). Such a task is listed by exactly one worker: among the live
workers of the app that consume the task's queue, the one that ranks the task highest (a hash of
task id and node name, the same on every host: rendezvous hashing, as the dedup gate spreads its
shards, ``worker/rules/shard_owners.py``). Workers that see the same members agree with no
coordination, and a worker that joins or leaves moves only the tasks it gains or had.

Every worker learns its peers and their queues from their heartbeats (``QueueMembership``,
``worker/remote/queue_members.py``): a heartbeat carries ``task_queues``, a field Celery ignores.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from typing import Final

__all__ = ["QUEUES_FIELD", "lister_of"]

# The worker event field that names the task queues a worker consumes (ours; Celery ignores it).
QUEUES_FIELD: Final = "task_queues"


def lister_of(task_id: str, queue: str, members: Mapping[str, Collection[str]]) -> str | None:
    """The worker that lists ``task_id``, waiting to go back to ``queue``: None if no member
    consumes that queue.

    Args:
        task_id: the parked task.
        queue: its task queue.
        members: each live worker's name and the task queues it consumes.
    """
    consumers = [name for name, queues in members.items() if queue in queues]
    if not consumers:
        return None
    return max(consumers, key=lambda name: (_rank(task_id, name), name))


def _rank(task_id: str, name: str) -> bytes:
    return hashlib.blake2b(f"{task_id}\x00{name}".encode(), digest_size=8).digest()
