"""A connection's prefetch from a time budget: deep for short tasks, 1 for long ones, moved rarely."""

from __future__ import annotations

import pytest

from worker.rules.prefetch_budget import MAX_PER_THREAD, PrefetchBudget


def test_short_tasks_deepen_the_prefetch_after_a_few_and_long_ones_bring_it_to_one_at_once():
    budget = PrefetchBudget(0.01, current=1)
    assert [budget.observe(0.001) for _ in range(3)] == [None, None, 10]  # 10 ms of 1 ms tasks
    assert budget.observe(0.5, long=True) == 1  # one task that ran past the budget: careful at once
    assert budget.observe(0.001) is None  # one short task after it: the long one still counts
    assert budget.observe(0.001) == 10  # short ones are the majority again


def test_shallower_only_at_a_quarter_and_once_per_window():
    budget = PrefetchBudget(0.01, current=1)
    for _ in range(16):
        budget.observe(0.0002)
    assert budget.current == 50
    # Tasks three times longer (the machine busy): 16 asked, not a quarter of 50: no change.
    assert all(budget.observe(0.0006) is None for _ in range(16))
    changes = [budget.observe(0.002) for _ in range(16)]  # 5 asked once they are the median
    assert len([c for c in changes if c]) == 1 and budget.current <= 12


def test_it_is_capped_per_thread_and_scaled_by_threads():
    budget = PrefetchBudget(0.01, threads=4, current=4)
    for _ in range(3):
        change = budget.observe(1e-6)
    assert change == MAX_PER_THREAD * 4
    slow = PrefetchBudget(0.01, threads=4, current=4)
    assert [slow.observe(1.0, long=True) for _ in range(3)] == [None, None, None]  # 1 per thread


def test_small_moves_are_not_made():
    budget = PrefetchBudget(0.01, current=1)
    for _ in range(3):
        budget.observe(0.004)  # 2 per thread: twice the current one
    assert budget.current == 2
    assert all(budget.observe(0.0035) is None for _ in range(10))  # 2 or 3: not worth a change


def test_a_budget_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        PrefetchBudget(0.0)
