"""Periodic tasks across the two implementations: our scheduler's fires run on a Celery worker,
and ``celery beat``'s fires run on our worker.

Our scheduler (``clockwork-beat``) puts ``clockwork_beat_*`` headers and a deterministic task id on
each fire and asks for the answer on its journal stream (``reply_to``): the Celery worker must run
the fires as plain tasks, and its rpc backend's answer must read as "finished" in the journal,
which is what ``overlap="skip"`` waits for. ``beat.tick`` is the same task on both sides
(``tests/interop/celery_app.py``, ``tests/integration/beat_tasks.py``): it appends what it ran to
a runs file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from broker_svc import Settings
from broker_svc.connection.beat_journal import Journal
from broker_svc.schedules import fire_id
from broker_svc.topology import LEGACY_NAMESPACE, beat_journal_stream
from tests.infra.session_broker import SessionBroker
from tests.interop.conftest import CeleryWorker, celery_worker
from tests.support.beats import BeatProcess, new_journal, runs, schedule_env, tick_entry, wait_runs
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

OUR_APP = "tests.integration.beat_tasks:app"
CELERY_APP = "tests.interop.celery_app"
BEAT_HEADERS = {"clockwork_beat_entry", "clockwork_beat_scheduled", "clockwork_beat_epoch"}


@pytest.fixture(scope="module")
def url(session_broker: SessionBroker) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-beat-interop") as vhost_url:
        yield vhost_url


@dataclass(frozen=True)
class CeleryQueue:
    name: str
    worker: CeleryWorker


@pytest.fixture(scope="module")
def celery_queue(url: str) -> Iterator[CeleryQueue]:
    """A queue a real Celery worker consumes, with two threads: runs could overlap if sent so."""
    name = unique_queue("celery-beat")
    with celery_worker(url, name, "threads", concurrency=2) as worker:
        yield CeleryQueue(name, worker)


def _celery_problems(worker: CeleryWorker) -> list[str]:
    """What the Celery worker logged as wrong: errors, warnings, tracebacks."""
    return [
        line
        for line in worker.log_text().splitlines()
        if any(word in line for word in ("ERROR", "WARNING", "CRITICAL", "Traceback"))
    ]


def test_our_scheduler_fires_each_second_once_on_a_celery_worker_which_answers_to_the_journal(
    url: str, celery_queue: CeleryQueue, tmp_path: Path
):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    env = schedule_env({"tick": tick_entry(journal, celery_queue.name)})
    with BeatProcess(url, scheduler=scheduler, env=env) as beat:
        wait_runs(journal, 5)
        assert beat.terminate() == 0
        fired = [event["task_id"] for event in beat.events() if event["event"] == "beat_fired"]
    # The scheduler has stopped: every fire it sent runs, once.
    wait_for(
        lambda: {run["id"] for run in runs(journal)} >= set(fired),
        timeout_s=20,
        message=f"the Celery worker ran every fire of {fired}",
    )
    done = runs(journal)
    assert sorted(run["id"] for run in done) == sorted(fired)
    times = sorted(run["scheduled"] for run in done)
    assert [round(b - a, 6) for a, b in zip(times, times[1:], strict=False)] == [1.0] * (len(times) - 1)
    journal_stream = beat_journal_stream(scheduler, LEGACY_NAMESPACE).name
    for run in done:
        assert run["id"] == fire_id("tick", run["scheduled"]), run
        assert (run["entry"], run["run_now"], run["reply_to"]) == ("tick", None, journal_stream), run
        assert BEAT_HEADERS <= set(run["headers"]) and "BCC" not in run["headers"], run
        assert isinstance(run["epoch"], int) and run["epoch"] >= 1, run
    # Each answer the Celery worker sent to the journal reads as the end of its run.
    reader = Journal(Settings(broker_url=url), scheduler)
    wait_for(
        lambda: not reader.read_state()[0].open_runs,
        timeout_s=20,
        message="the Celery worker's answers in the journal closed the runs",
    )
    assert _celery_problems(celery_queue.worker) == []


def test_overlap_skip_learns_from_the_celery_workers_answers_so_runs_never_overlap(
    url: str, celery_queue: CeleryQueue, tmp_path: Path
):
    journal = new_journal(tmp_path)
    env = schedule_env({"slow": tick_entry(journal, celery_queue.name, seconds=2.2, overlap="skip")})
    with BeatProcess(url, scheduler=f"s-{uuid.uuid4().hex[:8]}", env=env) as beat:
        # Without the answers, the first run would stay open (for overlap_timeout_s, an hour).
        wait_runs(journal, 3, timeout_s=40)
        skipped = beat.count("beat_fire_skipped")
    done = sorted(runs(journal), key=lambda run: run["start"])
    assert all(later["start"] >= earlier["end"] for earlier, later in zip(done, done[1:], strict=False)), done
    assert all(run["id"] == fire_id("slow", run["scheduled"]) for run in done), done
    assert skipped >= 2  # a 1 s entry with 2.2 s runs skips at least one time per run
    assert _celery_problems(celery_queue.worker) == []


@dataclass(frozen=True)
class CeleryBeat:
    proc: subprocess.Popen[bytes]
    log: Path

    def sent_ids(self) -> set[str]:
        """The task ids of the fires it sent (``-l debug`` logs each after its publish)."""
        return set(re.findall(r"beat\.tick sent\. id->([0-9a-f-]+)", self.log.read_text()))


@contextmanager
def celery_beat(url: str, schedule: dict[str, Any], directory: Path) -> Iterator[CeleryBeat]:
    """``celery beat`` of ``tests/interop/celery_app.py`` with this ``beat_schedule``."""
    log = directory / "celery-beat.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", CELERY_APP, "beat", "-l", "debug",
        "-s", str(directory / "celerybeat-schedule"), "--pidfile=",
    ]  # fmt: skip
    env = {**os.environ, "INTEROP_BROKER_URL": url, "INTEROP_BEAT_SCHEDULE": json.dumps(schedule)}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield CeleryBeat(proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_celery_beat_fires_run_on_our_worker_again_and_again(url: str, tmp_path: Path):
    queue = unique_queue("from-celery-beat")
    journal = new_journal(tmp_path)
    with WorkerProcess(url, app=OUR_APP, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        with celery_beat(url, {"tick": tick_entry(journal, queue)}, tmp_path) as beat:
            done = wait_runs(journal, 3)
            ids = {run["id"] for run in done}
            wait_for(
                lambda: ids <= beat.sent_ids(),
                timeout_s=10,
                message=f"every run {ids} is a fire celery beat logged (see {beat.log})",
            )
            assert beat.proc.poll() is None, beat.log.read_text()[-3000:]
        failures = [
            event for event in worker.events() if event.get("level") in ("warning", "error", "critical")
        ]
    assert len(ids) == len(done), done  # each fire ran once
    assert all(run["entry"] is None for run in done)  # Celery's fires, not ours
    assert failures == []
