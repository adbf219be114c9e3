"""Rate limits shared by a worker's consuming children: one bucket per task, whichever child asks."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from worker.shared.rates import SharedRates

NAMES = ("other", "t", "unlimited")  # every process of a worker attaches with the same names


def _reserve(path: str, count: int, out: multiprocessing.SimpleQueue) -> None:
    # When each token is due (wall clock, the same in every process of the machine).
    rates = SharedRates(Path(path), NAMES, owner=False)
    out.put([time.time() + rates.reserve("t") for _ in range(count)])
    rates.close()


def test_children_take_turns_from_one_bucket():
    rates = SharedRates.create(NAMES, {"t": 10.0, "other": 1.0})
    try:
        context = multiprocessing.get_context("spawn")
        out = context.SimpleQueue()
        children = [context.Process(target=_reserve, args=(str(rates.path), 10, out)) for _ in range(2)]
        for child in children:
            child.start()
        for child in children:
            child.join(30)
        due = sorted(out.get() + out.get())
        # Twenty tokens at 10/s from one bucket: never two within 0.1 s, whichever child took them
        # and however far apart the children started (each asks for a second's worth, so their
        # asks overlap unless one starts a second after the other; a bucket per child would then
        # put two tokens at once).
        gaps = [later - earlier for earlier, later in zip(due, due[1:], strict=False)]
        assert min(gaps) >= 0.09, gaps
        assert due[-1] - due[0] >= 1.8
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
