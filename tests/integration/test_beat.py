"""The periodic scheduler on the local broker: one of several instances fires, each time once,
across a leader's death, a restart and runtime changes.

The entries fire ``beat.tick`` (``tests/integration/beat_tasks.py``) every second on one worker
shared by the module; each test has a scheduler name and a runs journal of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, PublishError, Settings, Signature, Unroutable
from broker_svc.schedules import Entry, Every, fire_id
from broker_svc.schedules.client import ScheduleClient
from broker_svc.topology import LEGACY_NAMESPACE, beat_term_exchange
from tests.infra.session_broker import SessionBroker
from tests.support.amqp import delete_queues, queue_depth, queue_exists
from tests.support.beats import BeatProcess, new_journal, runs, schedule_env, tick_entry, wait_runs
from tests.support.waiting import poll, wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue
from worker.beat.scheduler import Beat

APP = "tests.integration.beat_tasks:app"
CTL = str(Path(sys.executable).parent / "ctl")


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
    env = schedule_env({"tick": tick_entry(journal, queue)})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with (
        BeatProcess(url, scheduler=scheduler, env=env) as a,
        BeatProcess(url, scheduler=scheduler, env=env) as b,
    ):
        wait_runs(journal, 4)
        assert [a.leading(), b.leading()].count(True) == 1
        fired = sorted(
            (event["scheduled"], event["late_s"])
            for process in (a, b)
            for event in process.events()
            if event["event"] == "beat_fired"
        )
    times = _assert_each_time_once(runs(journal))
    assert times[0] == int(times[0])  # anchored at the epoch: every instance agrees on the times
    # A new leader fires the time it just missed, up to the 1 s grace late (broker_svc/schedules/
    # due.py:due_times), plus its send; every later time fires on time.
    (_, first_late), *steady = fired
    assert first_late < 1.0 + 1.0, fired
    assert max(late for _, late in steady) < 1.0, fired


def test_a_killed_leader_is_replaced_and_no_time_is_missed_or_doubled(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": tick_entry(journal, queue, catch_up="all")})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with (
        BeatProcess(url, scheduler=scheduler, env=env) as a,
        BeatProcess(url, scheduler=scheduler, env=env) as b,
    ):
        before = len(wait_runs(journal, 3))
        leader, other = (a, b) if a.leading() else (b, a)
        schedules = ScheduleClient(Settings(broker_url=url), scheduler)
        term = schedules.leader()
        assert term is not None and term.leader == leader.first("beat_leading")["leader"]
        leader.kill()
        other.first("beat_leading", timeout_s=30)
        wait_runs(journal, before + 5)
        # The next leader names itself, in the next term.
        after = schedules.leader()
        assert after is not None and after.leader == other.first("beat_leading")["leader"]
        assert after.epoch == term.epoch + 1 and after.at > term.at
    _assert_each_time_once(runs(journal))


def test_with_the_default_catch_up_a_failover_doubles_no_time_but_fires_only_the_latest_it_missed(
    url: str, queue: str, tmp_path: Path
):
    # What README.md and the guide ("Failover") say of catch_up="once": the times that fell due
    # while no one led collapse into one fire, of the latest of them; none fires twice.
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": tick_entry(journal, queue)})  # catch_up: the default, "once"
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with (
        BeatProcess(url, scheduler=scheduler, env=env) as a,
        BeatProcess(url, scheduler=scheduler, env=env) as b,
    ):
        before = len(wait_runs(journal, 3))
        leader, other = (a, b) if a.leading() else (b, a)
        leader.kill()
        other.first("beat_leading", timeout_s=30)
        wait_runs(journal, before + 3)
        fired = [e for e in other.events() if e["event"] == "beat_fired"]
    done = runs(journal)
    times = sorted(run["scheduled"] for run in done)
    assert len({run["id"] for run in done}) == len(done) and len(set(times)) == len(times), times
    gaps = [round(later - earlier, 6) for earlier, later in zip(times, times[1:], strict=False)]
    # The lease (2 s) alone outlasts a second: at least one time was missed, and dropped.
    assert max(gaps) >= 2.0, gaps
    # The new leader's first fire is the latest time missed: late by less than a period and its send.
    assert fired[0]["late_s"] < 1.0 + 1.0, fired[0]


def test_a_restarted_scheduler_reads_its_journal_and_fires_nothing_again(
    url: str, queue: str, tmp_path: Path
):
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": tick_entry(journal, queue, catch_up="skip")})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    with BeatProcess(url, scheduler=scheduler, env=env) as first:
        wait_runs(journal, 3)
        assert first.terminate() == 0  # hands over: saves the state
    fired = max(run["scheduled"] for run in runs(journal))
    with BeatProcess(url, scheduler=scheduler, env=env) as second:
        second.first("beat_leading")
        done = wait_runs(journal, len(runs(journal)) + 3)
    ids = [run["id"] for run in done]
    assert len(set(ids)) == len(ids)
    assert sorted(run["scheduled"] for run in done) == sorted({run["scheduled"] for run in done})
    # catch_up="skip": what fell due while none ran is dropped, the rest is on time.
    after = sorted(run["scheduled"] for run in done if run["scheduled"] > fired)
    assert all(round(b - a, 6) == 1.0 for a, b in zip(after, after[1:], strict=False)), after


def test_overlap_skip_never_starts_a_run_while_the_last_one_runs(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    env = schedule_env({"slow": tick_entry(journal, queue, seconds=2.2, overlap="skip")})
    with BeatProcess(url, scheduler=f"s-{uuid.uuid4().hex[:8]}", env=env) as beat:
        wait_runs(journal, 3, timeout_s=60)
        skipped = beat.count("beat_fire_skipped")
    done = sorted(runs(journal), key=lambda run: run["start"])
    assert all(later["start"] >= earlier["end"] for earlier, later in zip(done, done[1:], strict=False)), done
    assert skipped >= 2  # a 1 s entry with 2.2 s runs skips at least one time per run


def test_schedule_changes_at_runtime_add_pause_run_now_resume_and_remove_and_last(
    url: str, queue: str, tmp_path: Path
):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    app = App("beat-changes", settings=Settings(broker_url=url))
    schedules = app.control.schedules(scheduler)
    try:
        with BeatProcess(url, scheduler=scheduler, env=schedule_env({})) as beat:
            beat.first("beat_leading")
            schedules.add("added", "beat.tick", 1.0, args=[str(journal), 0.0], options={"queue": queue})
            wait_runs(journal, 2)
            schedules.pause("added")
            wait_for(lambda: beat.count("beat_schedule_changed") >= 2, timeout_s=10, message="pause applied")
            paused_at = len(runs(journal))
            change_id = schedules.run_now("added")
            wait_runs(journal, paused_at + 1)
            # Paused: in 2.5 s nothing fires but the run-now.
            assert poll(lambda: len(runs(journal)) > paused_at + 1, timeout_s=2.5) is None
            assert [run["run_now"] for run in runs(journal)[paused_at:]] == [change_id]
        # The changes are durable: a new scheduler of the name has the entry, still paused.
        [listed] = schedules.list()
        assert (listed.entry.name, listed.entry.paused, listed.source, listed.next_fire) == (
            "added",
            True,
            "added",
            None,
        )
        with BeatProcess(url, scheduler=scheduler, env=schedule_env({})) as again:
            again.first("beat_leading")
            schedules.resume("added")
            count = len(runs(journal))
            wait_runs(journal, count + 2)
            schedules.remove("added")
            wait_for(
                lambda: again.count("beat_schedule_changed") >= 2, timeout_s=10, message="remove applied"
            )
            count = len(runs(journal)) + 1  # one fire may have been on its way
            assert poll(lambda: len(runs(journal)) > count, timeout_s=2.5) is None  # removed: none fires
        assert schedules.list() == []
        with pytest.raises(KeyError, match="no entry 'added'"):
            schedules.pause("added")
    finally:
        app.close()
    scheduled = [run for run in runs(journal) if run["run_now"] is None]
    assert len({run["scheduled"] for run in scheduled}) == len(scheduled)


def test_ctl_schedule_lists_the_configured_entries_and_changes_them(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    env = schedule_env({"tick": tick_entry(journal, queue, catch_up="skip")})

    def ctl(*argv: str) -> tuple[int, str, str]:
        # A real subprocess, as a user runs it (in-process, ctl would configure this process's logging).
        args = [CTL, "schedule", *argv, "--scheduler", scheduler, "-b", url]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT)
        return done.returncode, done.stdout, done.stderr

    with BeatProcess(url, scheduler=scheduler, env=env) as beat:
        beat.first("beat_leading")
        wait_runs(journal, 1)
        status, listed, _ = ctl("list")
        assert status == 0
        [leader, header, row] = listed.splitlines()
        # Which instance leads: the identity its election logs, and its term.
        leading = beat.first("beat_leading")
        assert leader.startswith(
            f"scheduler {scheduler!r}: led by {leading['leader']} (term {leading['epoch']}, since "
        )
        assert header.split()[:4] == ["NAME", "TASK", "SCHEDULE", "STATE"]
        assert row.split()[:5] == ["tick", "beat.tick", "every", "1s", "active"]
        args = json.dumps([str(journal), 0.0])
        cron = ["--cron", "* * * * *", "--timezone", "Europe/Berlin"]
        assert ctl("add", "minutely", "beat.tick", *cron, "--args", args, "--queue", queue)[0] == 0
        assert ctl("pause", "tick")[0] == 0
        wait_for(
            lambda: beat.count("beat_schedule_changed") >= 2, timeout_s=10, message="the changes applied"
        )
        status, shown, _ = ctl("list", "--json")
        entries = {entry["name"]: entry for entry in json.loads(shown)}
        assert entries["tick"]["paused"] is True and entries["tick"]["source"] == "configured"
        assert entries["minutely"]["schedule"]["timezone"] == "Europe/Berlin"
        assert entries["minutely"]["next_fire"].endswith(":00.000+00:00")
        assert ctl("run-now", "minutely")[0] == 0
        wait_for(
            lambda: any(run["entry"] == "minutely" and run["run_now"] for run in runs(journal)),
            timeout_s=20,
            message="the run-now ran",
        )
        status, _, err = ctl("remove", "nosuch")
        assert status == 1 and "no entry 'nosuch'" in err
    status, _, err = ctl("add", "bad", "beat.tick", "--cron", "61 * * * *")
    assert status == 2 and "crontab minute: 61" in err  # a usage error, as argparse reports one


def test_workers_with_dash_b_run_one_scheduler_between_them(url: str, queue: str, tmp_path: Path):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    env = schedule_env({"tick": tick_entry(journal, queue)})
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
        wait_runs(journal, 4)
        assert a.count("beat_leading") + b.count("beat_leading") == 1
    _assert_each_time_once(runs(journal))


def test_an_entry_of_a_registered_task_goes_to_the_queue_it_declares(url: str, tmp_path: Path):
    # As Celery's beat sends through apply_async: the task's declared queue, not the default one.
    declared = unique_queue("beat-declared")
    journal = new_journal(tmp_path)
    entry = {"task": "beat.declared", "schedule": 1.0, "args": [str(journal)]}
    env = schedule_env({"declared": entry}, BEAT_TEST_DECLARED_QUEUE=declared)
    try:
        with BeatProcess(url, scheduler=f"s-{uuid.uuid4().hex[:8]}", env=env):
            wait_for(lambda: queue_exists(url, declared) and queue_depth(url, declared) >= 2, timeout_s=30,
                     message="fires in the declared queue")  # fmt: skip
        assert not queue_exists(url, "celery") or queue_depth(url, "celery") == 0
    finally:
        delete_queues(url, declared)


def test_the_next_leader_fences_the_last_one_out_of_firing(url: str, queue: str, tmp_path: Path):
    """A leader that lost its term (frozen between its lease check and its publish, say) finds
    its term's exchange deleted by the next leader: the broker refuses its late fire."""
    journal = new_journal(tmp_path)
    env = schedule_env({"tick": tick_entry(journal, queue)})
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    app = App("beat-fence", settings=Settings(broker_url=url))

    def through(exchange: str) -> None:
        late = Signature("beat.tick", (str(journal), 0.0), {}, {"exchange": exchange, "routing_key": queue})
        app.send_many([late], wait=True)

    try:
        with BeatProcess(url, scheduler=scheduler, env=env) as first:
            epoch = first.first("beat_leading")["epoch"]
            exchange = beat_term_exchange(scheduler, LEGACY_NAMESPACE, epoch).name
            wait_runs(journal, 1)  # the leader has bound the task queue to its router
            through(exchange)  # while the term lasts, its exchange routes to the task queue
            first.kill()
        with BeatProcess(url, scheduler=scheduler, env=env) as second:
            assert second.first("beat_leading")["fenced"] == [epoch]
            with pytest.raises(Unroutable, match="no exchange"):
                through(exchange)
            before = len(runs(journal))
            wait_runs(journal, before + 2)  # the new leader fires through its own
    finally:
        app.close()
    assert sum(1 for run in runs(journal) if run["entry"] is None) == 1  # the one sent in the first term


def test_a_fire_whose_confirm_is_lost_is_not_sent_again_once_the_journal_has_it(
    url: str, queue: str, tmp_path: Path
):
    """The fire reached the broker but its confirm did not reach the leader (the connection broke
    in between): the leader reads the journal before firing again, finds it, and does not resend."""
    journal = new_journal(tmp_path)
    app = App("beat-lost-confirm", settings=Settings(broker_url=url))
    entry = Entry(
        name="tick", task="beat.tick", schedule=Every(1.0), args=(str(journal), 0.0), options={"queue": queue}
    )
    beat = Beat(app, name=f"s-{uuid.uuid4().hex[:8]}", entries=[entry], lease_s=2.0)
    send_many = beat._sender.send_many
    lost: list[str] = []

    def confirm_lost_once(signatures: Any, *, wait: bool = False) -> Any:
        sent = send_many(signatures, wait=wait)  # the broker takes it...
        if not lost:
            lost.extend(result.id for result in sent)
            # ...the leader hears nothing, and its journal follower, cut off by the same network
            # trouble, reads nothing either: only reading the journal again tells it.
            follower, beat._follower = beat._follower, None
            assert follower is not None
            follower.close()
            raise PublishError("connection lost before the confirm (injected)")
        return sent

    beat._sender.send_many = confirm_lost_once  # type: ignore[method-assign]
    try:
        beat.start()
        wait_runs(journal, 4)
    finally:
        beat.stop()
        app.close()
    done = runs(journal)
    assert lost and [run["id"] for run in done].count(lost[0]) == 1
    _assert_each_time_once(done)
