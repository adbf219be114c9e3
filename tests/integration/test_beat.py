"""The periodic scheduler on the local broker: one of several instances fires, each time once,
across a leader's death, a restart and runtime changes.

The entries fire ``beat.tick`` (``tests/integration/beat_tasks.py``) every second on one worker
shared by the module; each test has a scheduler name and a runs journal of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc.schedules import fire_id
from tests.infra.session_broker import SessionBroker
from tests.support.beats import BeatProcess, new_journal, runs, schedule_env
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.integration.beat_tasks:app"


@pytest.fixture(scope="module")
def url(session_broker: SessionBroker) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-beat") as vhost_url:
        yield vhost_url


@pytest.fixture(scope="module")
def queue(url: str) -> Iterator[str]:
    name = unique_queue("beat")
    with WorkerProcess(url, app=APP, queues=[name], concurrency=2) as worker:
        worker.wait_ready()
        yield name


def _tick(journal: Path, queue: str, **extra: Any) -> dict[str, Any]:
    seconds = extra.pop("seconds", 0.0)
    return {
        "task": "beat.tick",
        "schedule": 1.0,
        "args": [str(journal), seconds],
        "options": {"queue": queue},
        **extra,
    }


def _wait_runs(journal: Path, count: int, timeout_s: float = 40.0) -> list[dict[str, Any]]:
    wait_for(lambda: len(runs(journal)) >= count, timeout_s=timeout_s, message=f"{count} runs in {journal}")
    return runs(journal)


def _assert_each_time_once(done: list[dict[str, Any]], *, entry: str = "tick") -> list[float]:
    """Every run a fire of ``entry``, no time twice, no second missed between the first and last."""
    times = sorted(run["scheduled"] for run in done)
    assert all(run["entry"] == entry for run in done), done
    assert len({run["id"] for run in done}) == len(done), "a task id ran twice"
    assert len(set(times)) == len(times), f"a time fired twice: {times}"
    assert [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)] == [1.0] * (len(times) - 1), (
        times
    )
    assert all(run["id"] == fire_id(entry, run["scheduled"]) for run in done)
    return times


def test_of_two_schedulers_one_leads_and_each_second_fires_once(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": _tick(journal, queue)})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with (
        BeatProcess(url, scheduler=scheduler, env=env) as a,
        BeatProcess(url, scheduler=scheduler, env=env) as b,
    ):
        _wait_runs(journal, 5)
        assert [a.leading(), b.leading()].count(True) == 1
        late = [
            event["late_s"]
            for process in (a, b)
            for event in process.events()
            if event["event"] == "beat_fired"
        ]
    times = _assert_each_time_once(runs(journal))
    assert times[0] == int(times[0])  # anchored at the epoch: every instance agrees on the times
    assert max(late) < 1.0, late


def test_a_killed_leader_is_replaced_and_no_time_is_missed_or_doubled(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": _tick(journal, queue, catch_up="all")})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with (
        BeatProcess(url, scheduler=scheduler, env=env) as a,
        BeatProcess(url, scheduler=scheduler, env=env) as b,
    ):
        before = len(_wait_runs(journal, 3))
        leader, other = (a, b) if a.leading() else (b, a)
        leader.kill()
        other.first("beat_leading", timeout_s=30)
        _wait_runs(journal, before + 6)
    _assert_each_time_once(runs(journal))


def test_a_restarted_scheduler_reads_its_journal_and_fires_nothing_again(
    url: str, queue: str, tmp_path: Path
):
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": _tick(journal, queue, catch_up="skip")})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with BeatProcess(url, scheduler=scheduler, env=env) as first:
        _wait_runs(journal, 3)
        assert first.terminate() == 0  # hands over: saves the state
    fired = max(run["scheduled"] for run in runs(journal))
    with BeatProcess(url, scheduler=scheduler, env=env) as second:
        second.first("beat_leading")
        done = _wait_runs(journal, len(runs(journal)) + 3)
    ids = [run["id"] for run in done]
    assert len(set(ids)) == len(ids)
    assert sorted(run["scheduled"] for run in done) == sorted({run["scheduled"] for run in done})
    # catch_up="skip": what fell due while none ran is dropped, the rest is on time.
    after = sorted(run["scheduled"] for run in done if run["scheduled"] > fired)
    assert all(round(b - a, 6) == 1.0 for a, b in zip(after, after[1:], strict=False)), after


def test_overlap_skip_never_starts_a_run_while_the_last_one_runs(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    env = schedule_env({"slow": _tick(journal, queue, seconds=2.2, overlap="skip")})
    with BeatProcess(url, scheduler=f"s-{uuid.uuid4().hex[:8]}", env=env) as beat:
        _wait_runs(journal, 3, timeout_s=60)
        skipped = beat.count("beat_fire_skipped")
    done = sorted(runs(journal), key=lambda run: run["start"])
    assert all(later["start"] >= earlier["end"] for earlier, later in zip(done, done[1:], strict=False)), done
    assert skipped >= 2  # a 1 s entry with 2.2 s runs skips at least one time per run


def test_workers_with_dash_b_run_one_scheduler_between_them(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    env = schedule_env({"tick": _tick(journal, queue)})
    args = ["-B", "--scheduler-name", scheduler, "--beat-lease", "2"]
    with (
        WorkerProcess(
            url, app=APP, queues=[unique_queue("idle")], concurrency=1, env=env, extra_args=args
        ) as a,
        WorkerProcess(
            url, app=APP, queues=[unique_queue("idle")], concurrency=1, env=env, extra_args=args
        ) as b,
    ):
        a.wait_ready()
        b.wait_ready()
        _wait_runs(journal, 4)
        assert a.count("beat_leading") + b.count("beat_leading") == 1
    _assert_each_time_once(runs(journal))
