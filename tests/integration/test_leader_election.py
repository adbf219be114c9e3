"""Leader election on the local broker: one leader among several processes, and a graceful handover."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc.settings import Settings
from tests.infra.session_broker import SessionBroker
from tests.reliability.leader_journal import check, gaps
from tests.support.leaders import Candidates
from tests.support.waiting import wait_for
from worker.leader import Election, Term

LEASE_S = 2.0


@pytest.fixture(scope="module")
def vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-leader") as url:
        yield url


@pytest.fixture
def candidates(vhost_url: str, tmp_path: Path) -> Iterator[Candidates]:
    group = Candidates(vhost_url, f"role-{uuid.uuid4().hex[:8]}", tmp_path, lease_s=LEASE_S)
    try:
        yield group
    finally:
        group.close()


def test_one_of_three_processes_leads_and_each_sigterm_hands_over_with_no_overlap_and_no_lease_wait(
    candidates: Candidates,
):
    candidates.spawn(3)
    first = candidates.wait_new_term(0, timeout_s=20, message="one of three candidates leads")
    for _ in range(2):
        leader = candidates.current()
        sent = candidates.signal(leader.holder, signal.SIGTERM)
        following = candidates.wait_new_term(sent, timeout_s=10, message="the next one leads after SIGTERM")
        ended = candidates.wait_stop(leader.holder, leader.epoch, timeout_s=5)
        assert ended.extra["graceful"] is True
        assert following.epoch > leader.epoch
        # The handover marker, not the lease: the next one starts well before a lease could run out.
        assert following.start - ended.end < LEASE_S / 2
        assert candidates.processes[leader.holder].wait(timeout=10) == 0
    verdict = check(candidates.directory)
    assert verdict.ok, verdict
    assert verdict.terms == 3 and first.epoch >= 1
    # At any moment at most one term was open, and every handover left a gap under the handover.
    assert all(0 <= gap < LEASE_S / 2 for gap in gaps(candidates.intervals()))


class _Counting:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int, object]] = []

    def inaugurate(self, term: Term) -> None:
        self.seen.append(("inaugurate", term.epoch, term.handover_state))

    def execute(self, term: Term) -> None:
        while term.wait(0.05):
            term.guard()

    def hand_over(self, term: Term) -> object:
        self.seen.append(("hand_over", term.epoch, term.still_leader()))
        return {"from": term.epoch}


def test_an_embedded_election_hands_its_state_to_the_next_leader_on_stop(vhost_url: str):
    settings = Settings.from_url(vhost_url, heartbeat_s=1, connect_timeout_s=3.0)
    role = f"embedded-{uuid.uuid4().hex[:8]}"
    hooks = [_Counting(), _Counting()]
    elections = [Election(settings, name=role, hooks=h, lease_s=LEASE_S) for h in hooks]
    for election in elections:
        election.start()
    try:
        wait_for(lambda: any(e.is_leader() for e in elections), timeout_s=10, message="a leader")
        leader = next(e for e in elections if e.is_leader())
        other = elections[1 - elections.index(leader)]
        assert not other.is_leader()
        began = time.monotonic()
        leader.stop(timeout_s=10)
        wait_for(other.is_leader, timeout_s=5, message="the other one leads after stop()")
        assert time.monotonic() - began < LEASE_S
        old, new = hooks[elections.index(leader)], hooks[elections.index(other)]
        assert old.seen[-1][0] == "hand_over" and old.seen[-1][2] is True
        epoch = old.seen[-1][1]
        # The new term's runner calls inaugurate once the term has begun: wait for it, not after it.
        wait_for(lambda: new.seen, timeout_s=5, message="the new leader was inaugurated")
        assert new.seen[-1] == ("inaugurate", epoch + 1, {"from": epoch})
    finally:
        for election in elections:
            election.stop(timeout_s=10)
