"""Keyed dedup end to end: one running, at most one waiting, the rest declined; the safety timeout;
a gate that dies hands its keys to the next worker. Real workers, a vhost of this module's own."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import App, Settings, TaskDeclined, TaskError
from broker_svc.topology import LEGACY_NAMESPACE, dedup_gate_queue
from broker_svc.wire.records.dedup import GATE_SHARDS, shard_of
from tests.infra.session_broker import SessionBroker
from tests.integration import dedup_tasks
from tests.support.events import EventTap
from tests.support.metrics import free_port, scrape
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

APP = "tests.integration.dedup_tasks:app"
QUEUE = "dedup-work"
REFRESH = dedup_tasks.refresh.name
COUNTED = dedup_tasks.refresh_counted.name
MISMATCHED = "dedup-mismatched"


@pytest.fixture(scope="module")
def dedup_url(session_broker: SessionBroker) -> Iterator[str]:
    # The gate's shard queues are per vhost: a vhost of our own, so no other test's worker keeps them.
    with session_broker.own_vhost("clockwork-dedup") as url:
        yield url


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def gate_worker(dedup_url: str, metrics_port: int) -> Iterator[WorkerProcess]:
    args = ["-E", "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1"]
    env = {"CLOCKWORK_TASK_STATES": "1"}
    with WorkerProcess(dedup_url, app=APP, queues=[QUEUE], concurrency=3, extra_args=args, env=env) as w:
        yield w.wait_ready()


@pytest.fixture(scope="module")
def client(dedup_url: str) -> Iterator[App]:
    # The tasks' own app sends them (so a task's own dedup_key is formed), pointed at our vhost.
    app = dedup_tasks.app
    app.conf.broker_url = dedup_url
    app.conf.task_states = True
    yield app
    app.close(timeout=10)


def _journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _runs(path: Path, key: str) -> list[tuple[float, float, str]]:
    # (start, end, task id) of each finished run of ``key``, in start order.
    starts: dict[str, float] = {}
    runs = []
    for entry in _journal(path):
        if entry["key"] != key:
            continue
        if entry["event"] == "start":
            starts[entry["task_id"]] = entry["at"]
        else:
            runs.append((starts[entry["task_id"]], entry["at"], entry["task_id"]))
    return sorted(runs)


def test_one_runs_one_waits_and_the_rest_are_declined(
    gate_worker: WorkerProcess, client: App, tmp_path: Path, dedup_url: str, metrics_port: int
):
    journal = tmp_path / "runs.jsonl"
    tap = EventTap(dedup_url, "dedup.#")
    calls = [
        dedup_tasks.refresh.apply_async((str(journal), "k1", 1.5), queue=QUEUE, dedup_key="k1")
        for _ in range(5)
    ]
    other = dedup_tasks.refresh.apply_async((str(journal), "k2", 0.0), queue=QUEUE, dedup_key="k2")
    assert other.get(timeout=30) == other.id  # another key is not held up by k1
    assert calls[0].get(timeout=30) == calls[0].id
    assert calls[1].get(timeout=30) == calls[1].id
    for declined in calls[2:]:
        with pytest.raises(TaskDeclined, match="k1"):
            declined.get(timeout=30)
        assert declined.state == "DECLINED"
    (first_start, first_end, first), (second_start, _, second) = _runs(journal, "k1")
    assert (first, second) == (calls[0].id, calls[1].id)
    assert second_start >= first_end  # the waiting one ran only once the head had finished
    wait_for(
        lambda: client.jobs.status(calls[4].id) == "DECLINED",
        timeout_s=30,
        message="DECLINED on the state stream",
    )
    stats = client.control.inspect(destination=[gate_worker.name]).dedup()[gate_worker.name]
    # A lone worker owns every shard: it pings each, and learns from the ping that it is active.
    assert stats["owned_shards"] == list(range(GATE_SHARDS)) and stats["keys"] == 0
    assert stats["active_shards"] == list(range(GATE_SHARDS))
    counted = {
        name: stats[name] for name in ("accepted", "blocked", "declined", "promoted", "released", "evicted")
    }
    assert counted == {"accepted": 2, "blocked": 1, "declined": 3, "promoted": 1, "released": 3, "evicted": 0}
    decisions = {
        dict(labels)["decision"]: value
        for (name, labels), value in scrape(metrics_port).items()
        if name == "clockwork_dedup_decisions_total"
    }
    assert decisions == {"accepted": 2, "blocked": 1, "declined": 3, "promoted": 1, "released": 3}
    with tap:
        seen = tap.wait(lambda events: len(events) >= 10, message="the gate's dedup-* events")
    assert Counter(event["type"] for event in seen) == {
        "dedup-accepted": 2, "dedup-blocked": 1, "dedup-declined": 3, "dedup-released": 3,
        "dedup-promoted": 1,
    }  # fmt: skip
    assert {e["uuid"] for e in seen if e["type"] == "dedup-declined"} == {c.id for c in calls[2:]}


def test_the_task_level_key_is_an_argument_of_the_call(
    gate_worker: WorkerProcess, tmp_path: Path, client: App
):
    journal = tmp_path / "users.jsonl"
    head = dedup_tasks.refresh_user.apply_async((str(journal), 7), queue=QUEUE)
    tail = dedup_tasks.refresh_user.apply_async(kwargs={"path": str(journal), "user_id": 7}, queue=QUEUE)
    extra = dedup_tasks.refresh_user.apply_async((str(journal), 7), queue=QUEUE)
    other = dedup_tasks.refresh_user.apply_async((str(journal), 8), queue=QUEUE)
    with pytest.raises(TaskDeclined):
        extra.get(timeout=30)
    assert [head.get(timeout=30), tail.get(timeout=30), other.get(timeout=30)] == [7, 7, 8]


def test_a_hung_head_is_stopped_at_its_safety_timeout_and_the_waiting_one_runs(
    gate_worker: WorkerProcess, client: App, tmp_path: Path
):
    journal = tmp_path / "hung.jsonl"
    hung = dedup_tasks.refresh.apply_async(
        (str(journal), "k3", 60.0), queue=QUEUE, dedup_key="k3", dedup_timeout=3
    )
    wait_for(lambda: len(_journal(journal)) == 1, timeout_s=30, message="the head started")
    sent = time.time()
    waiting = dedup_tasks.refresh.apply_async((str(journal), "k3", 0.0), queue=QUEUE, dedup_key="k3")
    with pytest.raises(TaskError) as stopped:
        hung.get(timeout=30)  # its hard time limit is the rest of its safety timeout
    assert stopped.value.exc_type == "TimeLimitExceeded"
    assert waiting.get(timeout=30) == waiting.id
    [(start, _, ran)] = _runs(journal, "k3")
    assert ran == waiting.id and start - sent < 10
    assert [e["task_id"] for e in _journal(journal) if e["event"] == "end"] == [
        waiting.id
    ]  # the hung one never ended


def test_a_killed_gate_hands_its_keys_to_the_next_worker(session_broker: SessionBroker, tmp_path: Path):
    journal = tmp_path / "failover.jsonl"
    with (
        session_broker.own_vhost("clockwork-dedup-failover") as url,
        App("dedup-failover", settings=Settings(broker_url=url)) as client,
    ):
        _failover(url, client, journal)


def _failover(url: str, client: App, journal: Path) -> None:
    first = WorkerProcess(url, app=APP, queues=[QUEUE], concurrency=2)
    second = WorkerProcess(url, app=APP, queues=[QUEUE], concurrency=2)
    with first, second:
        first.wait_ready()
        second.wait_ready()
        head = client.send_task(REFRESH, (str(journal), "k4", 4.0), queue=QUEUE, dedup_key="k4")
        wait_for(lambda: len(_journal(journal)) == 1, timeout_s=30, message="the head started")
        tail = client.send_task(COUNTED, (str(journal), "k4", 0.0), queue=QUEUE, dedup_key="k4")
        # The shards spread over both workers: the keeper is whichever holds k4's tail.
        keeper = wait_for(
            lambda: next((w for w in (first, second) if _held(client, w) == 1), None),
            timeout_s=30,
            message="the tail held by a gate",
        )
        assert keeper is not None
        keeper.signal_tree(signal.SIGKILL)
        keeper.proc.wait(timeout=30)
        survivor = second if keeper is first else first
        declined = client.send_task(REFRESH, (str(journal), "k4", 0.0), queue=QUEUE, dedup_key="k4")
        with pytest.raises(TaskDeclined):
            declined.get(timeout=60)  # the survivor replayed the head and the tail
        # Handed to the survivor, the held tail came back to the gate redelivered; it still runs
        # as a first delivery (the shard queue's count is not the task's delivery count).
        assert tail.get(timeout=60) == {"id": tail.id, "redelivered": False, "delivery_count": 0}
        survivor.first("dedup_gate_active")
    runs = _runs(journal, "k4")
    assert [r[2] for r in runs][-1] == tail.id
    ends = [end for _, end, task_id in runs if task_id == head.id]
    assert (
        len(ends) == 1 and runs[-1][0] >= ends[0]
    )  # the head ran to its end (here or again) before the tail


def _held(client: App, worker: WorkerProcess) -> int:
    stats = client.control.inspect(destination=[worker.name], timeout=5).dedup().get(worker.name) or {}
    return int(stats.get("waiting", 0))


def test_a_target_queue_declared_otherwise_does_not_stall_its_shard(
    session_broker: SessionBroker, tmp_path: Path
):
    journal = tmp_path / "mismatched.jsonl"
    with (
        session_broker.own_vhost("clockwork-dedup-mismatch") as url,
        App("dedup-mismatch", settings=Settings(broker_url=url)) as client,
        # A client that declares the queue quorum where the worker declares it classic: they
        # disagree (docs/guide.md asks them not to), so the gate's own declare gets a 406.
        App("dedup-quorum", settings=Settings(broker_url=url, quorum_queues=(MISMATCHED,))) as other,
        EventTap(url, routing_key="dedup.#") as tap,
        WorkerProcess(url, app=APP, queues=[QUEUE], concurrency=1, extra_args=["-E"]) as worker,
    ):
        worker.wait_ready()
        odd = other.send_task(REFRESH, (str(journal), "k6", 0.0), queue=MISMATCHED, dedup_key="k6")
        tap.wait(lambda _: bool(tap.of("dedup-accepted", uuid=odd.id)), message="the odd task sent on")
        worker.first("dedup_queue_declared_otherwise")  # on a side channel: the gate's is untouched
        # Its shard goes on deciding: a key of the same shard is accepted and runs.
        neighbour = next(k for k in (f"n{i}" for i in range(1000)) if shard_of(k) == shard_of("k6"))
        after = client.send_task(REFRESH, (str(journal), neighbour, 0.0), queue=QUEUE, dedup_key=neighbour)
        assert after.get(timeout=30) == after.id
        assert worker.count("dedup_gate_failed") == 0


def test_a_worker_whose_connection_is_closed_renews_each_transactional_subscription_once(
    session_broker: SessionBroker, tmp_path: Path
):
    ctl = session_broker.rabbitmqctl
    if ctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from the broker side)")
    journal = tmp_path / "reconnect.jsonl"
    with (
        session_broker.own_vhost("clockwork-dedup-reconnect") as url,
        App("dedup-reconnect", settings=Settings(broker_url=url)) as client,
        WorkerProcess(
            url, app=APP, queues=[QUEUE], concurrency=1, env={"CLOCKWORK_TASK_STATES": "1"}
        ) as worker,
    ):
        worker.wait_ready()
        first = client.send_task(REFRESH, (str(journal), "k9", 0.0), queue=QUEUE, dedup_key="k9")
        assert first.get(timeout=30) == first.id
        vhost = unquote(urlsplit(url).path[1:])
        out = ctl("list_connections", "-p", vhost, "-q", "--no-table-headers", "pid", "client_properties")
        for line in out.splitlines():
            if worker.name in line and f"{worker.name}.child-" not in line:
                ctl("close_connection", line.split("\t", 1)[0], "dedup test: forced disconnect")
        # The gate and both joiners subscribe again, each on its own schedule.
        lines = ("dedup_gate_subscribed", "chord_joiner_subscribed", "dependents_subscribed")
        wait_for(
            lambda: all(worker.count(line) >= 2 for line in lines), timeout_s=30, message="subscribed again"
        )
        again = client.send_task(REFRESH, (str(journal), "k9", 0.0), queue=QUEUE, dedup_key="k9")
        assert again.get(timeout=30) == again.id
        # The new subscription's consumer alone: a robust channel would have come back too, with
        # its consumers, beside it and outside its transaction.
        consumers = ctl("list_consumers", "-p", vhost, "-q", "--no-table-headers", "queue_name").split()
        gates = Counter(name for name in consumers if name.startswith("clockwork.dedup."))
        assert gates == {dedup_gate_queue(shard, LEGACY_NAMESPACE).name: 1 for shard in range(GATE_SHARDS)}
        # The chord joiner and the dependents' joiner renew their transactional subscriptions alike.
        joiners = Counter(
            name for name in consumers if name in ("clockwork.chords.celery", "clockwork.dependents.celery")
        )
        assert joiners == {"clockwork.chords.celery": 1, "clockwork.dependents.celery": 1}
