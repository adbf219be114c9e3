"""The leader journal checker finds overlapping terms, and the election's pure parts hold their rules."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from broker_svc.errors import DecodeError, LeadershipLost
from broker_svc.topology import LEGACY_NAMESPACE, leader_queue
from tests.reliability.leader_journal import Interval, check, check_intervals, record
from worker.leader.term import Term
from worker.leader.token import Token, decode_token, encode_token, last_term


def test_the_checker_finds_no_overlap_in_back_to_back_terms():
    verdict = check_intervals([Interval("a", 1, 0.0, 1.0, [0.5]), Interval("b", 2, 1.0, 2.0, [1.5])])
    assert verdict.ok and verdict.terms == 2


def test_the_checker_reports_overlapping_terms_and_acts_outside_a_term():
    verdict = check_intervals([Interval("a", 1, 0.0, 1.2), Interval("b", 2, 1.0, 2.0, [2.5])])
    assert verdict.overlaps == [("a#1", "b#2")]
    assert verdict.acts_outside == 1 and not verdict.ok


def test_a_killed_leader_s_term_ends_at_its_last_action_and_may_still_overlap():
    killed = Interval("a", 1, 0.0, None, [0.2, 1.5])
    assert killed.end == 1.5
    assert check_intervals([killed, Interval("b", 2, 1.0, 2.0)]).overlaps


def test_the_checker_reports_epochs_that_do_not_rise():
    verdict = check_intervals([Interval("a", 2, 0.0, 1.0), Interval("b", 2, 1.5, 2.0)])
    assert verdict.epochs_not_increasing == 1


def test_the_checker_reads_journal_files_and_skips_a_cut_line(tmp_path: Path):
    record(tmp_path / "a.jsonl", "start", epoch=1, at=0.0)
    record(tmp_path / "a.jsonl", "act", epoch=1, at=0.5)
    record(tmp_path / "a.jsonl", "stop", epoch=1, at=1.0, graceful=True)
    record(tmp_path / "b.jsonl", "start", epoch=2, at=0.9)
    with (tmp_path / "b.jsonl").open("a") as f:
        f.write('{"event": "act", "ep')
    assert check(tmp_path).overlaps == [("a#1", "b#2")]


def test_a_token_round_trips_and_garbage_is_a_decode_error():
    token = Token("token", "h.1", epoch=3, seq=7, handed_over=True, state={"k": [1]})
    assert decode_token(encode_token(token)) == token
    with pytest.raises(DecodeError):
        decode_token(b"\x00not json")
    with pytest.raises(DecodeError):
        decode_token(b'{"kind": "other", "holder": "x"}')


def test_the_last_term_is_the_highest_epoch_and_its_handover_wins():
    tokens = [Token("bid", "c"), Token("token", "a", 4, 9), Token("token", "b", 5, 1)]
    tokens.append(Token("token", "b", 5, 2))
    assert last_term(tokens) == Token("token", "b", 5, 2)
    handed = Token("token", "b", 5, 0, handed_over=True)
    assert last_term([*tokens, handed]) == handed
    assert last_term([Token("bid", "c")]) is None


def test_the_election_queue_is_a_quorum_queue_with_a_single_active_consumer():
    spec = leader_queue("beat", LEGACY_NAMESPACE)
    assert spec.name == "clockwork.leader.beat" and spec.durable
    assert spec.arguments == {"x-queue-type": "quorum", "x-single-active-consumer": True}


def test_a_term_is_valid_until_its_lease_runs_out_and_renewal_never_revives_it():
    term = Term(epoch=1, leader="a", lease_end=time.monotonic() + 0.05)
    assert term.still_leader() and term.ended_at is None
    assert term.wait(10.0) is False  # wakes when the lease runs out, not after 10 s
    with pytest.raises(LeadershipLost):
        term.guard()
    term.renew(time.monotonic() + 60)
    assert not term.still_leader()
    ended = term.ended_at
    assert ended is not None and ended <= time.time()


def test_a_step_down_wakes_a_waiting_leader_and_keeps_the_term_valid():
    term = Term(epoch=2, leader="a", lease_end=time.monotonic() + 60)
    term.step_down()
    assert term.wait(10.0) is False and term.stepping_down and term.still_leader()
    term.end()
    assert not term.still_leader() and term.lease_remaining_s == 0.0
