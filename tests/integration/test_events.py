"""Events on celeryev: worker online/heartbeat/offline and task-* in Celery's format, clocks in order."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from broker_svc import App
from tests.support.events import EventTap
from tests.support.pidbox import call, cast
from tests.support.workers import WorkerProcess


@pytest.fixture
def tap(test_vhost_url: str) -> Iterator[EventTap]:
    with EventTap(test_vhost_url) as t:
        yield t


def test_worker_online_heartbeats_at_freq_and_offline(test_vhost_url: str, queue: str, tap: EventTap):
    # TZ=Etc/GMT-2 is UTC+2; Celery's utcoffset counts hours *west*, so the event must say -2.
    with WorkerProcess(
        test_vhost_url, queues=[queue], concurrency=1, extra_args=["--heartbeat-interval", "0.5"],
        env={"TZ": "Etc/GMT-2"},
    ) as worker:  # fmt: skip
        worker.wait_ready()
        tap.wait(
            lambda ev: len(tap.of("worker-heartbeat", hostname=worker.name)) >= 4, message="4 heartbeats"
        )
        online = tap.of("worker-online", hostname=worker.name)
        beats = tap.of("worker-heartbeat", hostname=worker.name)
        assert len(online) == 1
        for event in online + beats:
            assert event["_headers"] == {"hostname": worker.name}
            assert event["_routing_key"] == event["type"].replace("-", ".")
            assert event["freq"] == 0.5 and event["pid"] == worker.pid
            assert event["utcoffset"] == -2
            assert event["sw_ident"] == "py-clockwork" and event["sw_sys"]
            assert isinstance(event["active"], int) and isinstance(event["processed"], int)
            assert len(event["loadavg"]) == 3
        gaps = [b["timestamp"] - a["timestamp"] for a, b in zip(beats, beats[1:], strict=False)]
        assert all(0.3 < gap < 0.9 for gap in gaps), gaps  # the true interval is what freq says
        clocks = [e["clock"] for e in online + beats]
        assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)
        assert worker.terminate() == 0
    tap.wait(lambda ev: bool(tap.of("worker-offline", hostname=worker.name)), message="worker-offline")
    assert all(raw[1].content_type == "application/json" for raw in tap.raw)


def test_task_events_in_causal_order(test_vhost_url: str, queue: str, tap: EventTap, client: App):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=["-E"]) as worker:
        worker.wait_ready()
        ok = client.send_task("tests.integration.e2e_tasks.add", args=(2, 3), queue=queue)
        sent_clock = client.clock.value  # the clock stamped on the task message
        assert ok.get(timeout=30) == 5
        bad = client.send_task("tests.integration.e2e_tasks.boom", args=("nope",), queue=queue)
        with pytest.raises(Exception, match="nope"):
            bad.get(timeout=30)
        tap.wait(
            lambda ev: (
                bool(tap.of("task-succeeded", uuid=ok.id)) and bool(tap.of("task-failed", uuid=bad.id))
            ),
            message="succeeded and failed events",
        )
    received, started, succeeded = (
        tap.of(t, uuid=ok.id)[0] for t in ("task-received", "task-started", "task-succeeded")
    )
    # sent < received < started < succeeded, by Lamport clock.
    assert sent_clock < received["clock"] < started["clock"] < succeeded["clock"]
    assert received["name"] == "tests.integration.e2e_tasks.add"
    assert received["args"] == "(2, 3)" and received["kwargs"] == "{}"
    assert received["retries"] == 0 and received["eta"] is None and received["root_id"] == ok.id
    assert succeeded["result"] == "5" and succeeded["runtime"] >= 0
    failed = tap.of("task-failed", uuid=bad.id)[0]
    assert failed["exception"].startswith("ValueError(") and "nope" in failed["exception"]
    assert "Traceback" in failed["traceback"]
    assert all(e["hostname"] == worker.name for e in tap.events if e["type"].startswith("task-"))


def test_task_events_follow_enable_and_disable_events(
    test_vhost_url: str, queue: str, tap: EventTap, client: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=[]) as worker:
        worker.wait_ready()
        first = client.send_task("tests.integration.e2e_tasks.add", args=(1, 1), queue=queue)
        assert first.get(timeout=30) == 2
        replies = call(test_vhost_url, "enable_events", destination=[worker.name], expect=1)
        assert replies[0][1] == {worker.name: {"ok": "task events enabled"}}
        second = client.send_task("tests.integration.e2e_tasks.add", args=(1, 2), queue=queue)
        assert second.get(timeout=30) == 3
        tap.wait(lambda ev: bool(tap.of("task-succeeded", uuid=second.id)), message="events once enabled")
        replies = call(test_vhost_url, "disable_events", destination=[worker.name], expect=1)
        assert replies[0][1] == {worker.name: {"ok": "task events disabled"}}
        third = client.send_task("tests.integration.e2e_tasks.add", args=(1, 3), queue=queue)
        assert third.get(timeout=30) == 4
        # The heartbeat command sends one at once; by then any event of the third task was sent too.
        before = len(tap.of("worker-heartbeat", hostname=worker.name))
        cast(test_vhost_url, "heartbeat", destination=[worker.name])
        tap.wait(
            lambda ev: len(tap.of("worker-heartbeat", hostname=worker.name)) > before, message="heartbeat"
        )
    assert tap.of("task-received", uuid=first.id) == []
    assert tap.of("task-received", uuid=third.id) == []


def test_worker_clock_follows_a_peer_event_free_request(test_vhost_url: str, queue: str, tap: EventTap):
    # A control request's clock reaches the worker's next event: one clock per process.
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        call(test_vhost_url, "ping", destination=[worker.name], clock=900_000, expect=1)
        cast(test_vhost_url, "heartbeat", destination=[worker.name])
        tap.wait(
            lambda ev: any(e["clock"] > 900_000 for e in tap.of("worker-heartbeat", hostname=worker.name)),
            message="a heartbeat past the request's clock",
        )
        worker.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert worker.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 30


@pytest.mark.parametrize("abusive", [-5, 2**40, "12abc", "1e9", [7], True, None])
def test_abusive_request_clocks_are_ignored_and_the_node_keeps_answering(
    test_vhost_url: str, queue: str, tap: EventTap, abusive: object
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as worker:
        worker.wait_ready()
        replies = call(test_vhost_url, "clock", destination=[worker.name], clock=abusive, expect=1)  # type: ignore[arg-type]
        # Ignored, not clamped to the top: one bad peer must not drag every clock to the limit.
        assert replies[0][1][worker.name]["clock"] < 10_000
        assert replies[0][0]["clock"] < 10_000
        cast(test_vhost_url, "heartbeat", destination=[worker.name])
        tap.wait(lambda ev: bool(tap.of("worker-heartbeat", hostname=worker.name)), message="heartbeat")
        assert all(e["clock"] < 10_000 for e in tap.events if e.get("hostname") == worker.name)
        assert worker.proc.poll() is None


def test_events_with_no_one_listening_log_no_warning_or_error(test_vhost_url: str, queue: str, client: App):
    # -E with nobody consuming celeryev (no Flower, no ctl events): the broker drops the events,
    # which is normal, so the worker must not log a return or a failure for each one.
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=["-E"]) as worker:
        worker.wait_ready()
        for i in range(3):
            result = client.send_task("tests.integration.e2e_tasks.add", (i, 1), queue=queue)
            assert result.get(timeout=30) == i + 1
        # Stopped only once the dedup gate has subscribed on its own connection: a consume still in
        # flight at the stop is cancelled, and aiormq warns of it (seen on two busy cores).
        worker.first("dedup_gate_subscribed")
        assert worker.terminate() == 0  # whatever the returns would log is written by now
        noisy = [e for e in worker.events() if e.get("level") in ("warning", "error")]
        assert noisy == [], noisy
