"""What control calls return (pure): the replies of a broadcast, an inspect, a revoke."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypedDict, TypeVar

from control.protocol.request import Matcher

__all__ = [
    # what the client returns
    "BroadcastResult",
    "CallOptions",
    "InspectReply",
    "RevokeResult",
    # the shapes of Celery's inspect replies (``control.api.Inspect``)
    "ClockReply",
    "ErrorReply",
    "InspectResult",
    "OkReply",
    "ScheduledTask",
    "TaskInfo",
]


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


# -- the shapes of Celery's inspect replies, as workers send them (not checked on receipt) --------

_T = TypeVar("_T")


class OkReply(TypedDict):
    """A command that worked: ``{"ok": "pong"}``."""

    ok: str


class ErrorReply(TypedDict):
    """A command that failed on a node (unknown, bad arguments, handler error): ``{"error": "..."}``."""

    error: str


class ClockReply(TypedDict):
    """A node's Lamport clock: ``{"clock": n}``."""

    clock: int


# Celery's TASK_INFO (``Request.info``): id, name, args, kwargs, type, hostname, time_start,
# acknowledged, delivery_info, worker_pid.
TaskInfo: TypeAlias = dict[str, Any]


class ScheduledTask(TypedDict):
    """A task waiting for its ETA (inspect ``scheduled``)."""

    eta: str | None
    priority: int | None
    request: TaskInfo


# What an inspect call returns: ``{nodename: value}`` of the nodes that replied (a value is an
# ``ErrorReply`` where the command failed); with a single node name as destination, that node's
# value alone; None when no node replied.
InspectResult: TypeAlias = dict[str, _T | ErrorReply] | _T | ErrorReply | None
