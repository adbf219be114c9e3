"""Who leads a scheduler: the term record each leader writes, as ``ctl schedule list`` reads it."""

from __future__ import annotations

import json

from broker_svc.schedules.journal_record import RECORD_HEADER, TermOpened, classify
from broker_svc.schedules.state import BeatState
from control.cli.schedule import describe_leader


def _term(body: bytes) -> TermOpened:
    item = classify({RECORD_HEADER: "term"}, None, "application/json", body)
    assert isinstance(item, TermOpened)
    return item


def test_a_term_record_names_its_leader_and_an_older_one_reads_without_a_name():
    assert _term(TermOpened(3, "box.41.ab12cd", 1_700_000_000.5).encode()) == TermOpened(
        3, "box.41.ab12cd", 1_700_000_000.5
    )
    assert _term(json.dumps({"epoch": 2}).encode()) == TermOpened(2)


def test_the_state_keeps_the_latest_term_across_a_snapshot_and_never_goes_back():
    state = BeatState()
    state.apply(TermOpened(4, "b.2.x", 20.0))
    state.apply(TermOpened(3, "a.1.x", 10.0))  # an older record read after a newer one
    restored = BeatState.from_json(json.loads(json.dumps(state.to_json())))
    assert restored.term == TermOpened(4, "b.2.x", 20.0)
    assert BeatState.from_json({**state.to_json(), "term": None}).term is None


def test_ctl_names_the_leader_above_the_entries():
    assert describe_leader("default", None) == "scheduler 'default': no instance has led yet\n"
    line = describe_leader("default", TermOpened(7, "box.41.ab12cd", 1_700_000_000.0))
    assert line == "scheduler 'default': led by box.41.ab12cd (term 7, since 2023-11-14 22:13:20 UTC)\n"
    assert (
        describe_leader("x", TermOpened(2))
        == "scheduler 'x': led by an instance of an older version (term 2)\n"
    )
