"""The live workers of the members stream, and the task queues each one's heartbeats name."""

from __future__ import annotations

from typing import Any

from control.protocol.membership import Membership
from worker.rules.listers import QUEUES_FIELD

__all__ = ["QueueMembership"]


class QueueMembership(Membership):
    """Who is alive (``Membership``), and which task queues each says it consumes.

    A worker whose events name no queues (a Celery worker, an older Clockwork) lists nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[str, frozenset[str]] = {}

    def feed(self, event: Any) -> bool:
        """Take one event (see ``Membership.feed``), and the queues it names."""
        used = super().feed(event)
        if used:
            queues = event.get(QUEUES_FIELD)
            names = queues if isinstance(queues, list) else []
            self._queues[event["hostname"]] = frozenset(q for q in names if isinstance(q, str))
        return used

    def consumers(self, now: float) -> dict[str, frozenset[str]]:
        """The live workers (``Membership.alive``) and the task queues each consumes."""
        return {name: self._queues.get(name, frozenset()) for name in self.alive(now)}
