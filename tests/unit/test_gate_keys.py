"""The dedup gate's per-key state machine: head, tail, decline, release, eviction (pure)."""

from __future__ import annotations

import datetime as dt
import random

from broker_svc.wire.records.dedup import eta_wait_s
from worker.single_active.gate_keys import GateKeys, Verdict


def test_one_runs_one_waits_the_rest_are_declined():
    keys: GateKeys[str] = GateKeys()
    verdicts = [keys.arrive("k", f"t{i}", f"m{i}", timeout_s=10, now=0) for i in range(4)]
    assert verdicts == [Verdict.ACCEPT, Verdict.BLOCK, Verdict.DECLINE, Verdict.DECLINE]
    assert (keys.head_of("k"), keys.tail_of("k")) == ("t0", "t1")
    assert keys.counts.as_dict() | {} == {
        "accepted": 1, "blocked": 1, "declined": 2, "duplicate": 0, "released": 0, "evicted": 0,
        "promoted": 0, "stale": 0,
    }  # fmt: skip


def test_a_release_promotes_the_tail_and_the_key_is_forgotten_once_idle():
    keys: GateKeys[str] = GateKeys()
    keys.arrive("k", "a", "ma", timeout_s=10, now=0)
    keys.arrive("k", "b", "mb", timeout_s=20, now=1)
    assert keys.marker("k", "a", "marker-a", deadline=10)
    ended = keys.release("k", "a", now=5)
    assert ended is not None and ended.marker == "marker-a"
    assert ended.promoted is not None and ended.promoted.message == "mb" and ended.deadline == 25
    assert keys.head_of("k") == "b" and keys.tail_of("k") is None
    assert keys.arrive("k", "c", "mc", timeout_s=10, now=6) is Verdict.BLOCK
    last = keys.release("k", "b", now=7)
    assert last is not None and last.promoted is not None and last.promoted.task_id == "c"
    assert keys.release("k", "c", now=8) is not None
    assert len(keys) == 0 and keys.next_deadline() is None


def test_a_stale_release_and_a_resent_task_change_nothing():
    keys: GateKeys[str] = GateKeys()
    keys.arrive("k", "a", "ma", timeout_s=10, now=0)
    keys.arrive("k", "b", "mb", timeout_s=10, now=0)
    assert keys.arrive("k", "a", "again", timeout_s=10, now=0) is Verdict.DUPLICATE
    assert keys.arrive("k", "b", "again", timeout_s=10, now=0) is Verdict.DUPLICATE
    assert keys.release("k", "zzz", now=1) is None
    assert keys.release("other", "a", now=1) is None
    assert (keys.head_of("k"), keys.tail_of("k")) == ("a", "b")
    assert keys.counts.stale == 2 and keys.counts.declined == 0


def test_a_head_past_its_deadline_is_evicted_and_its_late_release_is_stale():
    keys: GateKeys[str] = GateKeys()
    keys.arrive("k", "a", "ma", timeout_s=10, now=0)
    keys.arrive("k", "b", "mb", timeout_s=30, now=1)
    assert keys.next_deadline() == 10
    assert keys.expired(9.9) == []
    [ended] = keys.expired(10)
    assert ended.task_id == "a" and ended.marker is None and ended.promoted is not None
    assert keys.head_of("k") == "b" and keys.next_deadline() == 40
    assert keys.release("k", "a", now=11) is None  # the evicted head finished after all
    assert not keys.marker("k", "a", "late-marker", deadline=10)  # its marker is stale too
    assert keys.counts.evicted == 1


def test_a_takeover_learns_heads_from_their_markers():
    keys: GateKeys[str] = GateKeys()
    assert keys.marker("k", "a", "marker-a", deadline=50)
    assert keys.arrive("k", "b", "mb", timeout_s=10, now=0) is Verdict.BLOCK
    assert keys.next_deadline() == 50
    ended = keys.release("k", "a", now=1)
    assert ended is not None and ended.marker == "marker-a"


def test_the_invariants_hold_over_random_histories():
    rng = random.Random(7)
    keys: GateKeys[int] = GateKeys()
    running: dict[str, str] = {}
    waiting: dict[str, str] = {}
    now, serial = 0.0, 0
    for _ in range(20_000):
        now += rng.random()
        key = f"k{rng.randrange(20)}"
        if rng.random() < 0.6:
            serial += 1
            verdict = keys.arrive(key, f"t{serial}", serial, timeout_s=30, now=now)
            if verdict is Verdict.ACCEPT:
                assert key not in running
                running[key] = f"t{serial}"
            elif verdict is Verdict.BLOCK:
                assert key in running and key not in waiting
                waiting[key] = f"t{serial}"
            else:
                assert verdict is Verdict.DECLINE and key in waiting
        elif key in running:
            ended = keys.release(key, running.pop(key), now=now)
            assert ended is not None
            if key in waiting:
                assert ended.promoted is not None and ended.promoted.task_id == waiting[key]
                running[key] = waiting.pop(key)
        for ended in keys.expired(now):
            assert running.pop(ended.key) == ended.task_id
            if ended.promoted is not None:
                running[ended.key] = waiting.pop(ended.key)
        assert len(keys) == len(running) and keys.waiting() == len(waiting)


def test_an_eta_lengthens_the_safety_timeout_by_the_wait_before_it():
    soon = (dt.datetime.now(dt.UTC) + dt.timedelta(seconds=100)).isoformat()
    assert 99 < eta_wait_s({"eta": soon}) <= 100
    assert eta_wait_s({"eta": "2001-01-01T00:00:00"}) == 0.0  # past: none
    assert eta_wait_s({"eta": "not a date"}) == 0.0 and eta_wait_s({}) == 0.0
