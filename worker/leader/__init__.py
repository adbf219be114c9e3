"""Leader election on RabbitMQ alone: one leader per role across processes and hosts, fenced.

``Election(settings, name=..., hooks=...)`` stands for a role; ``hooks`` implement ``inaugurate``,
``execute`` and ``hand_over`` (``LeaderHooks``), each given the ``Term``. See docs/guide.md,
"Leaders and ordered queues".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from broker_svc.errors import LeadershipLost
    from worker.leader.election import Election
    from worker.leader.term import LeaderHooks, Term

__all__ = [
    # the election and its hooks
    "Election",
    "LeaderHooks",
    "Term",
    # what a guard raises
    "LeadershipLost",
]

# Loaded on first use: importing the package does not open the connection module.
_EXPORTS = {
    "Election": "worker.leader.election",
    "LeaderHooks": "worker.leader.term",
    "Term": "worker.leader.term",
    "LeadershipLost": "broker_svc.errors",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
