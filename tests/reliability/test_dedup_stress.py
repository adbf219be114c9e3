"""Keyed dedup under load and under kills (RELIABILITY.md, K1-K2): the issue's proof, journaled.

Eight producer processes send keyed tasks (1,000 keys, Gaussian repeats) to four workers; the
task journals each run's start and end, the producers each send and each call's outcome, and the
gates their committed decisions as ``dedup-*`` events. ``dedup_check.check`` then asserts: never
two runs of a key at once, never more than one waiting (the events replay through the gate's own
state machine), every call SUCCESS or DECLINED, no lost final update, and declines counted
exactly. K2 SIGKILLs a worker's whole process tree every 10 s (the gate shards are spread over
the workers, so each kill takes a gate's shards, and its replacement takes a share back). Local
broker, a vhost of each test's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra.session_broker import SessionBroker
from tests.reliability.dedup_run import Plan, run_stress
from tests.reliability.journal import report

# After the last kill, every key's held work must be done within its safety timeout plus this:
# a replacement worker's start and the backlog the kill left, on a busy 2-core machine.
RECOVERY_MARGIN_S = 15.0


@pytest.fixture
def stress_url(session_broker: SessionBroker) -> Iterator[str]:
    # The gate shards are per vhost: one of our own, so no other test's worker is a gate here.
    with session_broker.own_vhost("clockwork-dedup-stress") as url:
        yield url


@pytest.mark.parametrize(
    "plan",
    [
        pytest.param(Plan(burst_size=150), id="8x150"),
        pytest.param(
            Plan(bursts=5, burst_size=200, period_s=3.0),
            id="8x1000",
            marks=[pytest.mark.chaos, pytest.mark.timeout(600)],
        ),
    ],
)
def test_k1_keyed_sends_keep_one_running_one_waiting_and_the_last_update(
    stress_url: str, tmp_path: Path, plan: Plan
):
    stress = run_stress(stress_url, tmp_path, plan)
    report("K1", **stress.verdict.figures, **stress.figures)
    assert stress.verdict.ok, "\n".join(stress.verdict.problems)
    figures = stress.verdict.figures
    # The Gaussian repeats must make the gate work: waits and declines, not only accepts.
    assert figures["blocked"] > 0 and figures["declined"] > 0, figures


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_k2_a_worker_killed_every_10_s_never_runs_a_key_twice_at_once_nor_loses_its_last_update(
    stress_url: str, tmp_path: Path
):
    # Bursts every 5 s for 85 s; a kill every 10 s, each 0.5 s into a burst, while keys are held.
    plan = Plan(bursts=18, burst_size=50, period_s=5.0, dedup_timeout_s=15.0, kills=8, kill_offset_s=0.5)
    stress = run_stress(stress_url, tmp_path, plan)
    report("K2", **stress.verdict.figures, **stress.figures)
    assert stress.verdict.ok, "\n".join(stress.verdict.problems)
    assert stress.figures["kills"] == 8 and stress.figures["gate_kills"] >= 4, stress.figures
    # Whatever was held at each kill (above all the last) was done within the safety timeout.
    recovery = stress.verdict.figures["recovery_s"]
    assert max(recovery) <= plan.dedup_timeout_s + RECOVERY_MARGIN_S, recovery
