"""Mingle: at start-up and after a reconnect, learn the peers' revoked ids and clocks (``hello``).

Celery's protocol (WIRE.md §6.3): broadcast ``hello(from_node, revoked)``, merge every reply's
revoked set, adjust the clock to every reply's clock. Celery waits for 1 s of silence; we wait
for the peers the members stream says are alive, so with known peers it ends as soon as they
have all answered, and with none it does not wait at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from control.aio.broadcaster import AsyncBroadcaster, read_members
from worker.remote.revoker import Revoker

__all__ = ["HELLO_REVOKED_LIMIT", "MingleResult", "mingle"]

log = structlog.get_logger(__name__)

# A hello (request or reply) carries at most this many revoked ids, newest first, so a node with
# 100,000 revokes never sends a reply of many megabytes.
HELLO_REVOKED_LIMIT: Final = 10_000


@dataclass(frozen=True, slots=True)
class MingleResult:
    """Who answered, who was skipped, and what we learned."""

    synced: tuple[str, ...]
    skipped: tuple[str, ...]
    new_revoked: int
    elapsed_s: float
    peers_known: bool


async def mingle(
    broadcaster: AsyncBroadcaster,
    members_channel: aio_pika.abc.AbstractChannel,
    *,
    nodename: str,
    revoker: Revoker,
    clock: LamportClock,
    namespace: str,
    timeout_s: float = 1.0,
) -> MingleResult:
    """Say hello to every peer and merge what they know; a bad reply is skipped, never fatal."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    alive = await read_members(members_channel, namespace=namespace)
    peers = None if alive is None else frozenset(alive - {nodename})
    synced: list[str] = []
    skipped: list[str] = []
    new = 0
    if peers is None or peers:
        arguments = {"from_node": nodename, "revoked": revoker.revoked.to_wire(limit=HELLO_REVOKED_LIMIT)}
        collector = await broadcaster.call("hello", arguments, expected=peers, timeout_s=timeout_s)
        for reply in collector.replies:
            [(node, value)] = reply.items()
            if node == nodename or value is None:
                continue
            if not isinstance(value, Mapping):
                log.warning("mingle_reply_skipped", node=node, reason=f"not a map: {type(value).__name__}")
                skipped.append(node)
                continue
            if "clock" in value:
                clock.adjust(value["clock"])
            else:
                clock.forward()
            revoked = value.get("revoked")
            if revoked is not None and not isinstance(revoked, Mapping | list):
                log.warning("mingle_reply_skipped", node=node, reason="revoked is neither a map nor a list")
                skipped.append(node)
                continue
            new += revoker.merge_peer(revoked or {})
            synced.append(node)
    result = MingleResult(
        synced=tuple(synced),
        skipped=tuple(skipped),
        new_revoked=new,
        elapsed_s=loop.time() - started,
        peers_known=peers is not None,
    )
    log.info(
        "mingle_done",
        synced=len(synced),
        nodes=list(synced),
        skipped=list(skipped),
        new_revoked=new,
        peers_known=result.peers_known,
        ms=round(result.elapsed_s * 1000, 1),
    )
    return result
