"""Deterministic waits for tests: poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


def poll(predicate: Callable[[], _T], *, timeout_s: float, interval_s: float = 0.02) -> _T | None:
    """Call ``predicate`` until it returns a truthy value or ``timeout_s`` passes.

    The predicate is always called at least once, and once more at the deadline, so a
    condition that becomes true during the last interval is not missed.

    Args:
        predicate: Zero-argument callable; a truthy result ends the wait.
        timeout_s: Seconds to keep polling.
        interval_s: Pause between calls.

    Returns:
        The first truthy result, or None if the deadline passed first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(interval_s, remaining))


def wait_for(predicate: Callable[[], _T], *, timeout_s: float, interval_s: float = 0.02, message: str) -> _T:
    """Wait until ``predicate`` returns a truthy value; fail the test at the deadline.

    This is the suite's replacement for bare ``sleep()`` calls.

    Args:
        predicate: Zero-argument callable; a truthy result ends the wait.
        timeout_s: Seconds to wait before failing.
        interval_s: Pause between calls.
        message: What was expected, for the failure report.

    Returns:
        The first truthy result of ``predicate``.

    Raises:
        AssertionError: The condition did not hold within ``timeout_s``.
    """
    result = poll(predicate, timeout_s=timeout_s, interval_s=interval_s)
    if not result:
        raise AssertionError(f"{message} (not true after {timeout_s:g} s)")
    return result


async def async_wait_for(
    predicate: Callable[[], Awaitable[_T]],
    *,
    timeout_s: float,
    interval_s: float = 0.02,
    message: str,
) -> _T:
    """Async twin of :func:`wait_for` for a coroutine predicate; never blocks the loop.

    Args:
        predicate: Zero-argument coroutine function; a truthy result ends the wait.
        timeout_s: Seconds to wait before failing.
        interval_s: Pause between calls.
        message: What was expected, for the failure report.

    Returns:
        The first truthy result of ``predicate``.

    Raises:
        AssertionError: The condition did not hold within ``timeout_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = await predicate()
        if result:
            return result
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise AssertionError(f"{message} (not true after {timeout_s:g} s)")
        await asyncio.sleep(min(interval_s, remaining))
