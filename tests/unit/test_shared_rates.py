"""Rate limits shared by a worker's consuming children: one bucket per task, whichever child asks."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from worker.feed.rates import SharedRates

NAMES = ("other", "t", "unlimited")  # every process of a worker attaches with the same names


def _reserve(path: str, count: int, out: multiprocessing.SimpleQueue) -> None:
    rates = SharedRates(Path(path), NAMES, owner=False)
    out.put([rates.reserve("t") for _ in range(count)])
    rates.close()


def test_children_take_turns_from_one_bucket():
    rates = SharedRates.create(NAMES, {"t": 10.0, "other": 1.0})
    try:
        context = multiprocessing.get_context("spawn")
        out = context.SimpleQueue()
        children = [context.Process(target=_reserve, args=(str(rates.path), 3, out)) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(30)
        waits = sorted(out.get() + out.get())
        # Six tokens at 10/s from one bucket: due 0, 0.1, ..., 0.5 s after the first (not 0..0.2 twice).
        assert waits[0] == pytest.approx(0.0, abs=0.05)
        assert waits[-1] >= 0.4
        assert rates.reserve("unlimited") == 0.0 and rates.rate("unlimited") is None
        assert rates.reserve("not registered") == 0.0
        assert rates.reserve("other") == pytest.approx(0.0, abs=0.05)  # buckets are apart
    finally:
        rates.close()
    assert not rates.path.exists()


def test_a_rate_set_by_the_worker_holds_in_a_child_at_once():
    rates = SharedRates.create(NAMES, {})
    child = SharedRates(rates.path, NAMES, owner=False)
    try:
        assert child.reserve("unlimited") == 0.0 and child.reserve("unlimited") == 0.0
        rates.set("unlimited", 4.0)  # the rate_limit command, in the worker
        assert child.rate("unlimited") == 4.0
        first, second = child.reserve("unlimited"), child.reserve("unlimited")
        assert first == pytest.approx(0.0, abs=0.05) and second == pytest.approx(0.25, abs=0.05)
        rates.set("unlimited", None)
        assert child.reserve("unlimited") == 0.0
    finally:
        child.close()
        rates.close()
