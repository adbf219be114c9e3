"""The keyed-dedup stress checker passes a good journal and fails each kind of bad one."""

from __future__ import annotations

from broker_svc.wire.records.dedup import shard_of
from tests.reliability.dedup_check import DedupVerdict, Kill, Mark, Sent, check, runs_of
from tests.reliability.dedup_replay import GateEvent, replay

GATE = "w1@test"


def _events(*decisions: str, gate: str = GATE) -> list[GateEvent]:
    # "accepted a" -> a dedup-accepted event for task a of key k
    return [GateEvent(d.split()[0], d.split()[1], "k", gate) for d in decisions]


def _run(
    task_id: str, start: float, end: float | None, *, pid: int = 10, key: str = "k", again: bool = False
) -> list[Mark]:
    marks = [Mark("start", key, task_id, pid, start, redelivered=again)]
    return marks if end is None else [*marks, Mark("end", key, task_id, pid, end)]


def _good() -> tuple[list[Sent], dict[str, str], list[Mark], list[GateEvent]]:
    # a runs; b waits for it, then runs; c is declined while b waits.
    sends = [Sent("k", "a", 0.0), Sent("k", "b", 0.1), Sent("k", "c", 0.2)]
    outcomes = {"a": "SUCCESS", "b": "SUCCESS", "c": "DECLINED"}
    marks = [*_run("a", 0.5, 1.0), *_run("b", 1.1, 1.5, pid=11)]
    events = _events("accepted a", "blocked b", "declined c", "released a", "released b")
    return sends, outcomes, marks, events


def _problems(verdict: DedupVerdict) -> str:
    return "\n".join(verdict.problems)


def test_a_good_journal_passes_with_its_figures():
    verdict = check(*_good())
    assert verdict.ok, verdict.problems
    figures = verdict.figures
    assert (figures["accepted"], figures["blocked"], figures["declined"], figures["released"]) == (1, 1, 1, 2)
    assert figures["max_waiting_per_key"] == 1 and figures["overlaps"] == 0


def test_two_runs_of_one_key_at_once_fail():
    sends, outcomes, _, events = _good()
    marks = [*_run("a", 0.5, 1.2), *_run("b", 1.1, 1.5, pid=11)]
    assert "overlap" in _problems(check(sends, outcomes, marks, events))


def test_a_second_waiting_task_fails_the_model_replay():
    sends, outcomes, marks, _ = _good()
    events = _events("accepted a", "blocked b", "blocked c", "released a", "released b")
    problems = _problems(check(sends, outcomes, marks, events))
    assert "the model disagrees" in problems and "blocked c, the model declined" in problems


def test_a_lost_final_update_fails():
    sends, outcomes, marks, events = _good()
    late = [*sends[:2], Sent("k", "c", 1.2)]  # c sent after b started, yet declined: lost
    assert "lost their final update" in _problems(check(late, outcomes, marks, events))


def test_a_failed_or_unanswered_call_fails():
    sends, outcomes, marks, events = _good()
    assert "not SUCCESS or DECLINED" in _problems(check(sends, {**outcomes, "b": "FAILURE"}, marks, events))
    del outcomes["c"]
    assert "not SUCCESS or DECLINED" in _problems(check(sends, outcomes, marks, events))


def test_declines_must_match_the_events_exactly():
    sends, outcomes, marks, events = _good()
    without = [e for e in events if e.decision != "declined"]
    problems = _problems(check(sends, outcomes, marks, without))
    assert "declines: model 0, events 0, calls 1" in problems and "no arrival event" in problems


def test_a_first_run_marked_redelivered_fails_without_a_fault():
    sends, outcomes, _, events = _good()
    marks = [*_run("a", 0.5, 1.0), *_run("b", 1.1, 1.5, pid=11, again=True)]
    assert "first runs marked redelivered" in _problems(check(sends, outcomes, marks, events))


def test_every_head_ends_once():
    sends, outcomes, marks, events = _good()
    problems = _problems(check(sends, outcomes, marks, events[:-1]))  # b never released
    assert "whose head never ended" in problems
    twice = [*events, GateEvent("released", "b", "k", GATE)]
    assert "ended more than once" in _problems(check(sends, outcomes, marks, twice))
    # With kills too, even of the shard's gate: a gate commits its events with its decisions.
    kill = Kill(at=0.3, pids=frozenset({99}), worker="w1@test", gate_shards=frozenset({shard_of("k")}))
    assert "no end event" in _problems(check(sends, outcomes, marks, events[:-1], kills=[kill]))
    assert check(sends, outcomes, marks, events, kills=[kill]).ok


def test_a_declined_call_that_ran_fails():
    sends, outcomes, marks, events = _good()
    assert "DECLINED calls ran" in _problems(check(sends, outcomes, [*marks, *_run("c", 2.0, 2.1)], events))


def test_a_killed_run_counts_as_running_until_its_kill():
    sends, outcomes, _, events = _good()
    kill = Kill(at=0.8, pids=frozenset({10}), worker="w0@test")
    # a was killed at 0.8 and ran again (redelivered), then b: no overlap, one rerun.
    marks = [*_run("a", 0.5, None), *_run("a", 0.9, 1.0, pid=12, again=True), *_run("b", 1.1, 1.5, pid=11)]
    verdict = check(sends, outcomes, marks, events, kills=[kill])
    assert verdict.ok, verdict.problems
    assert (verdict.figures["reruns"], verdict.figures["killed_runs"]) == (1, 1)
    assert verdict.figures["recovery_s"] == [0.7]  # b, sent before the kill, ended at 1.5
    # Had b started before the kill, a and b would have run at once.
    early = [*_run("a", 0.5, None), *_run("b", 0.7, 1.5, pid=11), *_run("a", 0.9, 1.0, pid=12, again=True)]
    assert "overlap" in _problems(check(sends, outcomes, early, events, kills=[kill]))


def test_a_run_again_after_a_kill_between_its_end_and_its_ack_must_come_after_the_kill_marked():
    sends, outcomes, _, events = _good()
    kill = Kill(at=0.8, pids=frozenset({10}), worker="w0@test")
    ended = [*_run("a", 0.5, 0.7), *_run("a", 0.9, 1.0, pid=12, again=True), *_run("b", 1.1, 1.5, pid=11)]
    assert check(sends, outcomes, ended, events, kills=[kill]).ok
    before_kill = [
        *_run("a", 0.5, 0.6),
        *_run("a", 0.7, 0.75, pid=12, again=True),
        *_run("b", 1.1, 1.5, pid=11),
    ]
    assert "ran again with no kill" in _problems(check(sends, outcomes, before_kill, events, kills=[kill]))
    unmarked = [*_run("a", 0.5, 0.7), *_run("a", 0.9, 1.0, pid=12), *_run("b", 1.1, 1.5, pid=11)]
    assert "unmarked" in _problems(check(sends, outcomes, unmarked, events, kills=[kill]))


def test_a_run_no_kill_ended_never_ends_and_a_rerun_needs_a_kill():
    sends, outcomes, _, events = _good()
    marks = [*_run("a", 0.5, None), *_run("a", 0.9, 1.0, pid=12), *_run("b", 1.1, 1.5, pid=11)]
    problems = _problems(check(sends, outcomes, marks, events))
    assert "never ended" in problems and "ran again with no kill" in problems and "overlap" in problems
    [killed, *_] = runs_of(marks, [Kill(at=0.8, pids=frozenset({10}))])
    assert (killed.end, killed.until) == (None, 0.8)


def test_a_later_gate_is_replayed_from_the_heads_its_markers_gave_it():
    # Gate 1 accepted a and blocked b, then died; gate 2 held a's marker and b again.
    takeover = [
        *_events("accepted a", "blocked b"),
        *_events("blocked b", "declined c", "released a", "released b", gate="w2@test"),
    ]
    found = replay(takeover, key_of={"a": "k", "b": "k", "c": "k"})
    assert (found.mismatch_count, found.takeovers, found.seeded_heads) == (0, 1, 1)
    # A later gate cannot decline before it held a tail: its blocked event would come first.
    bad = [*_events("accepted a", "blocked b"), *_events("declined c", gate="w2@test")]
    assert replay(bad, key_of={"a": "k", "b": "k", "c": "k"}).mismatch_count == 1
    # Nor may the first gate of a shard start with a head it never accepted.
    assert replay(_events("blocked b"), key_of={"b": "k"}).mismatch_count == 1


def test_a_shard_back_at_its_first_gate_is_replayed_from_the_markers_too():
    # Gate 1 accepted a and handed the shard to gate 2, which blocked b and handed it back: gate 1
    # learned a from its marker again, released it and promoted b.
    back = [
        *_events("accepted a"),
        *_events("blocked b", gate="w2@test"),
        *_events("blocked b", "released a", "promoted b", "released b"),
    ]
    found = replay(back, key_of={"a": "k", "b": "k"})
    assert (found.mismatch_count, found.takeovers, found.seeded_heads) == (0, 2, 2)


def test_without_kills_a_takeover_or_a_call_decided_twice_fails():
    sends, outcomes, marks, _ = _good()
    moved = [
        *_events("accepted a", "blocked b"),
        *_events("blocked b", "declined c", "released a", "released b", gate="w2@test"),
    ]
    problems = _problems(check(sends, outcomes, marks, moved))
    assert "more than one gate" in problems and "decided more than once" in problems


def test_an_eviction_promotes_the_tail_which_stays_the_head():
    events = _events("accepted a", "blocked b", "evicted a", "blocked c", "declined d", "evicted b")
    found = replay([*events, *_events("released c")], key_of=dict.fromkeys("abcd", "k"))
    assert found.mismatch_count == 0, found.mismatches
    assert (found.model["evicted"], found.model["blocked"], found.model["released"]) == (2, 2, 1)


def test_a_promotion_must_name_the_tail_the_model_promotes():
    sends, outcomes, marks, _ = _good()
    good = _events("accepted a", "blocked b", "declined c", "released a", "promoted b", "released b")
    assert check(sends, outcomes, marks, good).ok
    wrong = _events("accepted a", "blocked b", "declined c", "released a", "promoted c", "released b")
    assert "promoted c, the model's head is b" in _problems(check(sends, outcomes, marks, wrong))
