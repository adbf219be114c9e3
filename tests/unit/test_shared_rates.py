"""Rate limits shared by a worker's consuming children: one bucket per task, whichever child asks."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from worker.feed.rates import SharedRates

RATES = {"t": 10.0, "other": 1.0}  # every process of a worker attaches with the same map


def _reserve(path: str, count: int, out: multiprocessing.SimpleQueue) -> None:
    rates = SharedRates(Path(path), RATES, owner=False)
    out.put([rates.reserve("t") for _ in range(count)])
    rates.close()


def test_children_take_turns_from_one_bucket():
    rates = SharedRates.create(RATES)
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
        assert rates.reserve("unlimited") == 0.0 and not rates.limited("unlimited")
        assert rates.reserve("other") == pytest.approx(0.0, abs=0.05)  # buckets are apart
    finally:
        rates.close()
    assert not rates.path.exists()
