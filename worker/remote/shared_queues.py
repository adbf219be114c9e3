"""At start-up: does a worker of another app share one of our queues, or our app namespace?

Two apps on one queue (both on Celery's default ``celery``, say) take each other's tasks, and each
dead-letters the other's as ``NotRegistered``. The worker asks its peers which queues they consume
(``active_queues``) and, for those sharing one of ours, which tasks they register; a peer that
registers tasks this worker does not is named in one warning, with the queues and a few of those
tasks. Clockwork and Celery workers answer both commands alike.

Two apps in one app namespace (neither sets ``app_namespace``, say) share chords' joiner, dedup
gates, schedulers and the rest: a Clockwork peer whose ``stats`` name our namespace and whose
tasks are none of ours is named in a warning too. Both run in the background, after the worker
is ready, and never fail it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog

from control.aio.broadcaster import AsyncBroadcaster

__all__ = ["SharedQueue", "check_shared_namespace", "check_shared_queues"]

log = structlog.get_logger(__name__)

_SHOWN: Final = 5  # task names shown in the warning


@dataclass(frozen=True, slots=True)
class SharedQueue:
    """A peer that consumes some of our queues and registers tasks we do not."""

    peer: str
    queues: tuple[str, ...]
    their_tasks: tuple[str, ...]


async def check_shared_queues(
    broadcaster: AsyncBroadcaster,
    *,
    nodename: str,
    queues: Iterable[str],
    registered: Iterable[str],
    timeout_s: float = 2.0,
) -> list[SharedQueue]:
    """Warn about each peer that shares a queue with us and registers tasks we do not; returns them."""
    ours = set(queues)
    mine = {name for name in registered if not name.startswith("celery.")}
    consumed = await broadcaster.call("active_queues", {}, expected=None, timeout_s=timeout_s)
    sharing: dict[str, set[str]] = {}
    for node, value in _replies(consumed.replies, nodename):
        names = {q.get("name") for q in value if isinstance(q, Mapping)} if isinstance(value, list) else set()
        shared = {name for name in names if isinstance(name, str)} & ours
        if shared:
            sharing[node] = shared
    if not sharing:
        log.debug("shared_queue_check_done", peers_sharing=0, other_apps=0)
        return []
    known = await broadcaster.call("registered", {}, expected=frozenset(sharing), timeout_s=timeout_s)
    found: list[SharedQueue] = []
    for node, value in _replies(known.replies, nodename):
        if node not in sharing or not isinstance(value, list):
            continue
        # Celery lists "name [rate_limit=...]" when asked for attributes; the name comes first.
        theirs = {str(item).split(" ", 1)[0] for item in value}
        extra = sorted(name for name in theirs - mine if not name.startswith("celery."))
        if not extra:
            continue
        entry = SharedQueue(node, tuple(sorted(sharing[node])), tuple(extra))
        found.append(entry)
        log.warning(
            "queue_shared_with_another_app",
            peer=node,
            queues=list(entry.queues),
            their_tasks=list(extra[:_SHOWN]),
            their_task_count=len(extra),
            hint="tasks of theirs that reach this worker are dead-lettered as NotRegistered (and ours "
            "reaching them fail there): give each app a queue of its own (task_default_queue, -Q)",
        )
    log.debug("shared_queue_check_done", peers_sharing=len(sharing), other_apps=len(found))
    return found


async def check_shared_namespace(
    broadcaster: AsyncBroadcaster,
    *,
    nodename: str,
    namespace: str,
    registered: Iterable[str],
    timeout_s: float = 2.0,
) -> list[str]:
    """Warn about each peer of another app (no task in common) in our app namespace; returns them."""
    mine = {name for name in registered if not name.startswith("celery.")}
    stats = await broadcaster.call("stats", {}, expected=None, timeout_s=timeout_s)
    same = {
        node
        for node, value in _replies(stats.replies, nodename)
        if isinstance(value, Mapping) and value.get("app_namespace") == namespace
    }
    if not same or not mine:
        return []
    known = await broadcaster.call("registered", {}, expected=frozenset(same), timeout_s=timeout_s)
    found: list[str] = []
    for node, value in _replies(known.replies, nodename):
        if node not in same or not isinstance(value, list):
            continue
        theirs = {str(item).split(" ", 1)[0] for item in value} - {""}
        theirs = {name for name in theirs if not name.startswith("celery.")}
        if not theirs or theirs & mine:
            continue  # the same app (another version of it, during a deploy, shares most names)
        found.append(node)
        log.warning(
            "app_namespace_shared",
            peer=node,
            namespace=namespace,
            their_tasks=sorted(theirs)[:_SHOWN],
            hint="another app's workers share this app namespace: chord joining, dedup gates, "
            "schedulers, job states and revokes are shared with it; give each app its own "
            "app_namespace (clients and workers alike; docs/guide.md, 'Many apps on one broker')",
        )
    return found


def _replies(replies: Iterable[Mapping[str, Any]], nodename: str) -> Iterable[tuple[str, Any]]:
    for reply in replies:
        for node, value in reply.items():
            if node != nodename:
                yield node, value
