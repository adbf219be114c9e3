"""Collecting the replies to one mailbox request, and deciding when to stop waiting for more."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from broker_svc.logging import get_logger
from control.protocol.request import TICKET_HEADER

__all__ = ["ReplyCollector"]

log = get_logger(__name__)


class ReplyCollector:
    """The replies to one ticket, and whether every node we wait for has answered.

    Who we wait for: the destination list when the request named one; else the live members
    reported through ``expect()``. A call stops when they have all answered, when ``limit``
    replies came, or at the deadline — whichever is first. With neither a destination nor a
    non-empty membership view, only the limit or the deadline stop it (the timeout is the upper
    bound, as in Celery).

    Membership may change during a call: ``expect()`` replaces the current view, so a node whose
    heartbeats stop no longer holds the call up, but every node that was expected at any point
    and did not answer is reported in ``missing``.

    Args:
        ticket: the request's ticket; replies carrying another ticket are not ours.
        expected: the destination list, if the request named one.
        limit: stop after this many nodes answered (None: no limit).
        timeout_s: the total time a call may take.
        now: the start time (any monotonic clock; ``done()`` takes the same clock).
    """

    def __init__(
        self,
        ticket: str,
        *,
        expected: frozenset[str] | None,
        limit: int | None,
        timeout_s: float,
        now: float,
    ) -> None:
        self.ticket = ticket
        self.deadline = now + timeout_s
        self.skipped = 0
        self._destination = expected
        self._limit = limit
        self._by_node: dict[str, Any] = {}
        self._view: frozenset[str] | None = None  # live members matching the request, right now
        self._ever: set[str] = set()  # every node membership expected during the call

    def offer(self, headers: Mapping[str, Any] | None, body: Any) -> bool:
        """Take a decoded reply if it is for this ticket and well formed.

        A reply with no ticket header counts as ours, as kombu treats it. A body that is not a
        one-entry map ``{nodename: value}`` is skipped and counted in ``skipped``.

        Returns:
            True when the reply was taken.
        """
        ticket = (headers or {}).get(TICKET_HEADER)
        if ticket is not None and ticket != self.ticket:
            return False
        if not isinstance(body, Mapping) or len(body) != 1:
            self.skipped += 1
            log.warning("control_reply_malformed", ticket=self.ticket, body_type=type(body).__name__)
            return False
        [(node, value)] = body.items()
        if not isinstance(node, str) or not node:
            self.skipped += 1
            log.warning("control_reply_malformed", ticket=self.ticket, node_type=type(node).__name__)
            return False
        if node in self._by_node:
            # Two workers with one name (or a redelivered reply); the last one wins, as in Celery.
            log.warning("control_reply_duplicate_node", ticket=self.ticket, node=node)
            del self._by_node[node]  # so ``replies`` keeps arrival order of the kept reply
        self._by_node[node] = value
        return True

    def expect(self, nodes: Iterable[str]) -> None:
        """Set the live members this request is for, as membership sees them now.

        Ignored when the request named a destination. An empty view leaves the expected set
        unknown until a non-empty one is seen (no heartbeats known: wait out the timeout).
        """
        if self._destination is not None:
            return
        view = frozenset(nodes)
        if view or self._view is not None:
            self._view = view
            self._ever |= view

    @property
    def expected(self) -> frozenset[str] | None:
        """Every node we wait for (or waited for), or None when that is unknown."""
        if self._destination is not None:
            return self._destination
        return frozenset(self._ever) if self._view is not None else None

    @property
    def replies(self) -> list[dict[str, Any]]:
        """The replies taken, as one-entry maps in arrival order (one per node)."""
        return [{node: value} for node, value in self._by_node.items()]

    @property
    def answered(self) -> frozenset[str]:
        """Nodes that replied."""
        return frozenset(self._by_node)

    @property
    def missing(self) -> frozenset[str]:
        """Expected nodes that did not reply (empty when the expected set is unknown)."""
        return (self.expected or frozenset()) - self.answered

    def done(self, now: float) -> bool:
        """Whether the call can return: all expected answered, limit reached, or deadline passed."""
        if now >= self.deadline:
            return True
        if self._limit is not None and len(self._by_node) >= self._limit:
            return True
        waiting_for = self._destination if self._destination is not None else self._view
        return waiting_for is not None and waiting_for <= self._by_node.keys()
