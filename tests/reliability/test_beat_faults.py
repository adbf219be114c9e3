"""The periodic scheduler under faults (RELIABILITY.md, B1-B2): no second missed, none doubled.

Three ``clockwork-beat`` processes of one scheduler name fire ``beat.tick`` every second
(``catch_up="all"``) to one worker; every 30 s the leader is SIGKILLed (B1, B2) or, every other
time in B2, frozen with SIGSTOP and resumed once the next leader fired. The runs journal must hold
every second between the first run and the last exactly once, each under ``fire_id``. Local broker,
a vhost of its own.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc.schedules import fire_id
from tests.infra.session_broker import SessionBroker
from tests.reliability.beat_check import Fired, check_runs, lateness
from tests.reliability.beat_fleet import Fleet
from tests.reliability.journal import report
from tests.reliability.leader_cycles import summary
from tests.support.beats import new_journal, runs, schedule_env, tick_entry
from tests.support.waiting import poll, wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.integration.beat_tasks:app"
LEASE_S = 2.0
HEARTBEAT_S = 2  # the broker drops a frozen leader's connection after two missed heartbeats
FAULT_EVERY_S = 30.0


@pytest.fixture(scope="module")
def vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to see the task queue drained)")
    with session_broker.own_vhost("clockwork-beat-faults") as url:
        yield url


def _latest_run(journal: Path) -> float:
    return max((run["scheduled"] or 0.0 for run in runs(journal)), default=0.0)


def _run_until(journal: Path, instant: float) -> None:
    """Wait until a run scheduled at or after ``instant`` is journaled (the scheduler keeps firing)."""
    wait_for(
        lambda: _latest_run(journal) >= instant, timeout_s=max(0.0, instant - time.time()) + 30,
        interval_s=0.25, message=f"a run scheduled at {instant:.0f} or later",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("row", "duration_s", "faults"),
    [
        # Behind the chaos marker too: the suite is near its time budget, and test_beat.py's
        # killed-leader test checks the same in the default run (a kill, no time missed or doubled).
        pytest.param("B1", 45.0, ("kill",), id="45s", marks=[pytest.mark.chaos, pytest.mark.timeout(240)]),
        pytest.param(
            "B2", 600.0, ("kill", "freeze"), id="10min", marks=[pytest.mark.chaos, pytest.mark.timeout(1500)]
        ),
    ],
)
def test_a_scheduler_whose_leader_fails_every_30_s_fires_each_second_exactly_once(
    session_broker: SessionBroker, vhost_url: str, tmp_path: Path, row: str, duration_s: float,
    faults: tuple[str, ...],
):  # fmt: skip
    ctl = session_broker.rabbitmqctl
    assert ctl is not None
    vhost = unquote(urlsplit(vhost_url).path[1:]) or "/"
    queue = unique_queue("beat-faults")
    journal = new_journal(tmp_path)
    tick = tick_entry(journal, queue, catch_up="all")
    env = schedule_env({"tick": tick}, CLOCKWORK_HEARTBEAT_S=str(HEARTBEAT_S))
    fleet = Fleet(vhost_url, f"faults-{uuid.uuid4().hex[:8]}", env, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S)

    def queue_drained() -> bool:
        out = ctl("list_queues", "-p", vhost, "-q", "--no-table-headers", "name", "messages")
        depth = {line.split("\t")[0]: int(line.split("\t")[1]) for line in out.splitlines() if "\t" in line}
        return depth.get(queue, 0) == 0

    with WorkerProcess(vhost_url, app=APP, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        try:
            fleet.spawn(3)
            fleet.current()
            wait_for(lambda: runs(journal), timeout_s=30, message="the first run")
            start = time.time()
            kinds = itertools.cycle(faults)
            for k in range(1, int(duration_s // FAULT_EVERY_S) + 1):
                _run_until(journal, start + k * FAULT_EVERY_S)
                fleet.fault(next(kinds))
            _run_until(journal, max(start + duration_s, time.time() + 5))
            fleet.stop()
            fired = fleet.fires()
            last_fired = max((f.scheduled for f in fired), default=0.0)
            # Every fire the broker took runs: wait for the runs up to the last one logged, and
            # for the queue to be empty (a second copy of a time would still be in it).
            poll(
                lambda: _latest_run(journal) >= last_fired and queue_drained(), timeout_s=30, interval_s=0.25
            )
        finally:
            fleet.close()
    verdict = check_runs(runs(journal), entry="tick", period_s=1.0)
    late = lateness(fired)
    faults_made = sum(map(len, fleet.failover_s.values()))
    report(row, runs=verdict.runs, seconds=verdict.seconds, missed=verdict.missed, doubled=verdict.doubled,
           wrong_ids=verdict.wrong_ids, foreign=verdict.foreign, faults=faults_made,
           failover=summary(fleet.failover_s), late=late["all"], late_steady=late["steady"],
           lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S)  # fmt: skip
    assert (verdict.missed, verdict.doubled, verdict.wrong_ids, verdict.foreign) == (0, 0, 0, 0), verdict
    assert verdict.seconds >= duration_s - 2, verdict  # ran the whole time, through every fault
    assert _latest_run(journal) >= last_fired, "a fire the scheduler logged never ran"
    assert faults_made == int(duration_s // FAULT_EVERY_S)


def test_the_checker_counts_missed_doubled_misnamed_and_foreign_runs():
    def run(at: float, *, entry: str = "tick", task_id: str | None = None) -> dict[str, object]:
        return {"id": task_id or fire_id(entry, at), "entry": entry, "scheduled": at, "run_now": None}

    base = 1_800_000_000.0
    good = [run(base + i) for i in range(10)]
    assert check_runs(good, entry="tick", period_s=1.0).ok
    # base + 4 missing; base + 6 twice; a wrong id; an instant off the 1 s grid; another entry.
    extra = [good[6], run(base + 10, task_id="x"), run(base + 3.5), run(base, entry="other")]
    bad = [*good[:4], *good[5:], *extra]
    verdict = check_runs(bad, entry="tick", period_s=1.0)
    assert (verdict.missed, verdict.doubled, verdict.wrong_ids, verdict.foreign) == (1, 2, 1, 1)
    assert not verdict.ok
    late = lateness([Fired(base, 0.1, base - 5), Fired(base - 3, 3.2, base - 1)])
    assert (late["all"]["max_s"], late["steady"]["max_s"], late["steady"]["n"]) == (3.2, 0.1, 1)
