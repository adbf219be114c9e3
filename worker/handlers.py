"""Control command handlers bound to one worker's state."""

from __future__ import annotations

from typing import Any

from broker_svc.app import App
from broker_svc.clock import LamportClock
from control.commands import CommandRegistry
from control.protocol import ok
from worker.revoked import RevokedSet

__all__ = ["build_registry"]

# Mingle replies carry at most this many revoked ids, so 100,000 revokes never make a 7 MB reply.
HELLO_REVOKED_LIMIT = 10_000


def build_registry(*, app: App, clock: LamportClock, nodename: str, revoked: RevokedSet) -> CommandRegistry:
    """The registry of the commands this worker answers today."""
    registry = CommandRegistry()

    async def ping() -> dict[str, Any]:
        return ok("pong")

    async def clock_value() -> dict[str, Any]:
        return {"clock": clock.value}

    async def registered(taskinfoitems: list[Any] | None, builtins: bool) -> list[str]:
        return sorted(name for name in app.tasks if builtins or not name.startswith("celery."))

    async def revoked_ids() -> list[str]:
        return list(revoked)

    async def hello(from_node: str, revoked: dict[str, Any]) -> dict[str, Any] | None:
        if from_node == nodename:
            return None
        known.merge_wire(revoked)
        return {"revoked": known.to_wire(limit=HELLO_REVOKED_LIMIT), "clock": clock.forward()}

    known = revoked
    registry.register("ping", ping)
    registry.register("clock", clock_value)
    registry.register("registered", registered)
    registry.register("revoked", revoked_ids)
    registry.register("hello", hello)
    return registry
