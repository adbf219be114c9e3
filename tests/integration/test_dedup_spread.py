"""The dedup gate over several workers: its shards spread over the live ones and move when one
goes, every keyed task still decided and run once; and a gate killed the moment it commits has
told what it decided. Real workers, a vhost of each test's own."""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings, TaskDeclined
from broker_svc.wire.records.dedup import GATE_SHARDS, shard_of
from tests.infra.session_broker import SessionBroker
from tests.integration import dedup_tasks
from tests.integration.gate_fault_tasks import KILL_AFTER_COMMIT_ENV
from tests.support.events import EventTap
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

APP = "tests.integration.dedup_tasks:app"
FAULT_APP = "tests.integration.gate_fault_tasks:app"
QUEUE = "dedup-spread-work"
IDLE = "dedup-spread-idle"  # consumed by the workers that only keep gates: they run no task
REFRESH = dedup_tasks.refresh.name
ALL_SHARDS = list(range(GATE_SHARDS))


def _gates(client: App, workers: Sequence[WorkerProcess]) -> dict[str, dict[str, Any]]:
    names = [w.name for w in workers]
    replies = client.control.inspect(destination=names, timeout=5).dedup()
    return {name: replies[name] for name in names if name in replies}


def _spread(client: App, workers: Sequence[WorkerProcess]) -> dict[str, list[int]] | None:
    # Each shard active on exactly one of ``workers``, each worker on its share, as it owns them.
    gates = _gates(client, workers)
    if len(gates) != len(workers):
        return None
    active = {name: stats["active_shards"] for name, stats in gates.items()}
    share = GATE_SHARDS // len(workers)
    if sorted(s for shards in active.values() for s in shards) != ALL_SHARDS:
        return None
    if any(not share <= len(shards) <= share + 1 for shards in active.values()):
        return None
    if any(stats["active_shards"] != stats["owned_shards"] for stats in gates.values()):
        return None
    return active


def _send(client: App, journal: Path, keys: Sequence[str]) -> list[Any]:
    return [client.send_task(REFRESH, (str(journal), key, 0.0), queue=QUEUE, dedup_key=key) for key in keys]


def test_the_shards_spread_over_the_workers_and_move_when_one_is_killed_or_stopped(
    session_broker: SessionBroker, tmp_path: Path
):
    journal = tmp_path / "spread.jsonl"
    with (
        session_broker.own_vhost("clockwork-dedup-spread") as url,
        App("dedup-spread", settings=Settings(broker_url=url)) as client,
        WorkerProcess(url, app=APP, queues=[QUEUE], concurrency=2) as runner,
        WorkerProcess(url, app=APP, queues=[IDLE], concurrency=1) as killed,
        WorkerProcess(url, app=APP, queues=[IDLE], concurrency=1) as stopped,
    ):
        workers = [runner.wait_ready(), killed.wait_ready(), stopped.wait_ready()]
        spread = wait_for(lambda: _spread(client, workers), timeout_s=60, message="8 shards over 3 workers")
        assert spread is not None and sorted(len(shards) for shards in spread.values()) == [2, 3, 3]
        calls = _send(client, journal, [f"a{i}" for i in range(40)])
        # Killed in the middle of a stream of keys: its shards go to the next in line at once,
        # then to their owners once the others see it gone.
        calls += _send(client, journal, [f"b{i}" for i in range(40)])
        killed.signal_tree(signal.SIGKILL)
        calls += _send(client, journal, [f"c{i}" for i in range(40)])
        killed.proc.wait(timeout=30)
        survivors = [runner, stopped]
        spread = wait_for(lambda: _spread(client, survivors), timeout_s=60, message="8 shards over 2")
        assert spread is not None and sorted(len(shards) for shards in spread.values()) == [4, 4]
        calls += _send(client, journal, [f"d{i}" for i in range(40)])
        assert stopped.terminate() == 0  # stopped: the last worker takes every shard
        calls += _send(client, journal, [f"e{i}" for i in range(40)])
        assert wait_for(lambda: _spread(client, [runner]), timeout_s=60, message="8 shards on 1")
        assert [call.get(timeout=60) for call in calls] == [call.id for call in calls]
        takeovers = sum(w.count("dedup_gate_active") for w in workers)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    runs = Counter(line["task_id"] for line in lines if line["event"] == "start")
    assert runs == dict.fromkeys((call.id for call in calls), 1)  # every keyed task ran once
    assert takeovers > GATE_SHARDS  # shards moved, not only first taken


def test_the_workers_of_another_app_namespace_in_the_vhost_keep_none_of_our_shards(
    session_broker: SessionBroker,
):
    with (
        session_broker.own_vhost("clockwork-dedup-apps") as url,
        App("dedup-apps", settings=Settings(broker_url=url)) as client,
        WorkerProcess(url, app=APP, queues=[IDLE], concurrency=1) as first,
        WorkerProcess(url, app=APP, queues=[IDLE], concurrency=1) as second,
        WorkerProcess(
            url, app=APP, queues=["dedup-other-app"], concurrency=1, env={"CLOCKWORK_APP_NAMESPACE": "other"}
        ) as other,
    ):
        ours = [first.wait_ready(), second.wait_ready()]
        other.wait_ready()
        # They share the members stream (the control plane), not the gate shards.
        spread = wait_for(lambda: _spread(client, ours), timeout_s=60, message="8 shards over our 2")
        assert spread is not None and sorted(len(shards) for shards in spread.values()) == [4, 4]
        gates = _gates(client, [*ours, other])
        assert gates[first.name]["members"] == sorted([first.name, second.name])
        assert gates[other.name]["members"] == [other.name]
        assert gates[other.name]["owned_shards"] == ALL_SHARDS  # its own app's eight


def test_a_gate_killed_the_moment_it_commits_has_sent_the_events_and_records_of_that_commit(
    session_broker: SessionBroker, tmp_path: Path
):
    journal, armed = tmp_path / "commit.jsonl", tmp_path / "kill-after-commit"
    env = {"CLOCKWORK_TASK_STATES": "1"}
    with (
        session_broker.own_vhost("clockwork-dedup-commit") as url,
        App("dedup-commit", settings=Settings(broker_url=url, task_states=True)) as client,
        EventTap(url, "dedup.#") as tap,
        WorkerProcess(
            url, app=FAULT_APP, queues=[QUEUE], concurrency=1, extra_args=["-E"],
            env={**env, KILL_AFTER_COMMIT_ENV: str(armed)},
        ) as first,
    ):  # fmt: skip
        first.wait_ready()
        head = client.send_task(REFRESH, (str(journal), "k", 5.0), queue=QUEUE, dedup_key="k")
        tail = client.send_task(REFRESH, (str(journal), "k", 0.0), queue=QUEUE, dedup_key="k")
        # Told once committed: from here the key has its head and tail, and the gate is idle.
        tap.wait(lambda _: bool(tap.of("dedup-blocked", uuid=tail.id)), message="the tail held")
        wait_for(
            lambda: shard_of("k") in _gates(client, [first])[first.name]["active_shards"],
            timeout_s=30,
            message="the gate active on k's shard",
        )
        armed.touch()  # the gate's next commit is its last: the one with the declines below
        declined = [
            client.send_task(REFRESH, (str(journal), "k", 0.0), queue=QUEUE, dedup_key="k") for _ in range(3)
        ]
        assert first.proc.wait(timeout=30) == -signal.SIGKILL
        assert not armed.exists()
        with WorkerProcess(url, app=APP, queues=[QUEUE], concurrency=1, extra_args=["-E"], env=env) as second:
            second.wait_ready()
            for call in declined:
                with pytest.raises(TaskDeclined):
                    call.get(timeout=60)
            ids = {call.id for call in declined}
            tap.wait(
                lambda _: {e["uuid"] for e in tap.of("dedup-declined")} >= ids,
                timeout_s=30,
                message="a dedup-declined event for every declined call",
            )
            for call in declined:
                assert client.jobs.status(call.id) == "DECLINED"
            assert tail.get(timeout=60) == tail.id and head.get(timeout=60) == head.id
