"""The ordered-queue checker fails on journals that break the promise, and passes the one that keeps it."""

from __future__ import annotations

from typing import Any

from tests.support.order_journal import check_order


def _run(
    seq: int, node: str = "a@h", *, redelivered: bool = False, ends: bool = True
) -> list[dict[str, Any]]:
    start = {"phase": "start", "seq": seq, "node": node, "redelivered": redelivered}
    return [start, {**start, "phase": "end"}] if ends else [start]


def _journal(*runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for run in runs for line in run]


def test_in_order_one_at_a_time_passes():
    verdict = check_order(_journal(*(_run(i) for i in range(5))), expected=5)
    assert verdict.ok and verdict.done == 5 and verdict.nodes == ["a@h"]


def test_a_misordered_journal_fails():
    verdict = check_order(_journal(_run(0), _run(2), _run(1), _run(3)), expected=4)
    assert not verdict.ok
    assert verdict.out_of_order >= 1


def test_two_at_once_is_an_overlap():
    lines = [*_run(0), {"phase": "start", "seq": 1, "node": "a@h", "redelivered": False},
             {"phase": "start", "seq": 2, "node": "b@h", "redelivered": False},
             {"phase": "end", "seq": 1, "node": "a@h"},
             {"phase": "end", "seq": 2, "node": "b@h"}]  # fmt: skip
    verdict = check_order(lines, expected=3)
    assert verdict.overlaps == 1 and not verdict.ok


def test_a_lost_task_is_missing():
    verdict = check_order(_journal(_run(0), _run(2)), expected=3)
    assert verdict.missing == [1] and not verdict.ok


def test_the_marked_redelivery_at_a_failover_is_allowed():
    lines = _journal(_run(0), _run(1, ends=False), _run(1, "b@h", redelivered=True), _run(2, "b@h"))
    verdict = check_order(lines, expected=3, killed=["a@h"])
    assert verdict.ok, verdict
    assert verdict.repeats_marked == 1 and verdict.nodes == ["a@h", "b@h"]


def test_an_unmarked_repeat_or_a_killed_run_without_the_kill_fails():
    unmarked = _journal(_run(0), _run(1, ends=False), _run(1, "b@h"), _run(2, "b@h"))
    assert check_order(unmarked, expected=3, killed=["a@h"]).repeats_unmarked == 1
    not_killed = _journal(_run(0), _run(1, ends=False), _run(1, "b@h", redelivered=True))
    assert check_order(not_killed, expected=2).overlaps == 1


def test_a_repeat_on_the_same_node_counts_only_if_marked_and_last():
    # A broker restart can lose an ack the node sent: the task comes back to it, marked.
    marked = _journal(_run(0), _run(1), _run(1, redelivered=True))
    assert check_order(marked, expected=2).repeats_marked == 1
    unmarked = _journal(_run(0), _run(1), _run(1))
    assert check_order(unmarked, expected=2).repeats_unmarked == 1
    not_last = _journal(_run(0), _run(1), _run(2), _run(1, redelivered=True))
    assert check_order(not_last, expected=3).repeats_unmarked == 1
