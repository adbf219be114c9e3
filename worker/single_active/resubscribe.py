"""The loop that keeps a worker's own subscriber subscribed (the chord joiner, the dependents' releaser)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final

__all__ = ["RESUBSCRIBE_S", "resubscribing"]

RESUBSCRIBE_S: Final = (1.0, 60.0)  # first pause after a lost subscription, and the longest


async def resubscribing(
    serve: Callable[[], Awaitable[bool]], *, forget: Callable[[], None], log: Any, event: str
) -> None:
    """Run ``serve`` again whenever it returns or fails, with a backoff; until cancelled.

    Args:
        serve: subscribes and returns once the subscription is lost; True if it was made at all
            (then the next pause is the first one again, else it doubles).
        forget: drops what the lost subscription held (the broker requeued it).
        log: the caller's logger, which names the failure ``event``.
    """
    pause, longest = RESUBSCRIBE_S
    while True:
        subscribed = False
        try:
            subscribed = await serve()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the channel or connection failed: the broker requeued its messages
            log.warning(event, error=f"{type(exc).__name__}: {exc}", retry_in_s=pause)
        forget()
        await asyncio.sleep(pause)
        pause = RESUBSCRIBE_S[0] if subscribed else min(pause * 2, longest)
