"""FairSlots: round-robin across queues, FIFO within a queue, resizable, cancellation-safe."""

from __future__ import annotations

import asyncio

import pytest

from worker.consume.slots import FairSlots


async def _order_of_grants(slots: FairSlots, requests: list[tuple[str, str]]) -> list[str]:
    granted: list[str] = []

    async def take(queue: str, tag: str) -> None:
        await slots.acquire(queue)
        granted.append(tag)

    tasks = [asyncio.create_task(take(q, t)) for q, t in requests]
    await asyncio.sleep(0)
    for _ in requests:
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return granted


async def test_a_small_queue_is_served_in_turn_not_after_a_big_one_drains():
    slots = FairSlots(1)
    await slots.acquire("a")  # the one child is busy
    requests = [("a", f"a{i}") for i in range(100)] + [("b", "b0"), ("b", "b1")]
    granted = await _order_of_grants(slots, requests)
    # b's tasks start after at most one task of a each, not after a's 100.
    assert granted.index("b0") <= 2 and granted.index("b1") <= 4
    assert [g for g in granted if g.startswith("a")] == [f"a{i}" for i in range(100)]  # FIFO in a line


async def test_three_queues_rotate():
    slots = FairSlots(1)
    await slots.acquire("a")
    requests = [(q, f"{q}{i}") for q in "abc" for i in range(3)]
    granted = await _order_of_grants(slots, requests)
    assert granted[:6] == ["a0", "b0", "c0", "a1", "b1", "c1"]


async def test_capacity_and_resize():
    slots = FairSlots(2)
    await slots.acquire("a")
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("a"))
    await asyncio.sleep(0)
    assert slots.waiting == 1 and slots.waiting_in("a") == 1 and not waiter.done()
    slots.resize(3)  # the autoscaler grew the pool
    await asyncio.sleep(0)
    assert waiter.done() and slots.in_use == 3 and slots.waiting == 0
    slots.resize(1)  # shrink: holders keep their slots until they release
    for _ in range(3):
        slots.release()
    assert slots.in_use == 0
    await slots.acquire("a")
    blocked = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    assert not blocked.done()
    blocked.cancel()


async def test_a_cancelled_waiter_leaks_no_slot():
    slots = FairSlots(1)
    await slots.acquire("a")
    waiter = asyncio.create_task(slots.acquire("b"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    slots.release()
    assert slots.in_use == 0 and slots.waiting == 0
    await asyncio.wait_for(slots.acquire("c"), 1)


async def test_a_waiter_cancelled_after_it_was_granted_passes_the_slot_on():
    slots = FairSlots(1)
    await slots.acquire("a")
    first = asyncio.create_task(slots.acquire("b"))
    second = asyncio.create_task(slots.acquire("c"))
    await asyncio.sleep(0)
    slots.release()  # grants first ...
    first.cancel()  # ... which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)
    assert slots.in_use == 1


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        FairSlots(-1)
