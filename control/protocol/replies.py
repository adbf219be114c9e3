"""What control calls return (pure): the replies of a broadcast, an inspect, a revoke."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from control.protocol.request import Matcher

__all__ = ["BroadcastResult", "CallOptions", "InspectReply", "RevokeResult"]


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    """What a broadcast got back.

    Attributes:
        replies: one-entry maps ``{nodename: value}`` in arrival order (one per node).
        answered: nodes that replied.
        missing: nodes we waited for that did not reply (empty when that set was unknown).
        expected: the destination list, else the live members the request was for; None when
            membership was unknown (then the call waited out its timeout).
        elapsed_s: how long the call took.
    """

    replies: list[dict[str, Any]]
    answered: frozenset[str]
    missing: frozenset[str]
    expected: frozenset[str] | None
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class RevokeResult(BroadcastResult):
    """A broadcast ``revoke``, and whether its entry is on disk in the revocation log."""

    logged: bool = False


class CallOptions(TypedDict, total=False):
    """The options of ``ControlClient.broadcast`` that ``inspect`` takes too."""

    destination: str | Sequence[str] | None
    pattern: str | None
    matcher: Matcher | None
    timeout_s: float
    limit: int | None


class InspectReply(dict[str, Any]):
    """``{nodename: value}``, plus the nodes that were expected and did not answer."""

    def __init__(self, by_node: Mapping[str, Any], *, missing: frozenset[str] = frozenset()) -> None:
        super().__init__(by_node)
        self.missing = missing
