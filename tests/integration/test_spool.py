"""The producer's spool and batch publishing against the session's broker (faults: tests/reliability).

A broker that is down is a port nobody listens on here; the reliability tests stop a private node.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from broker_svc import App, PublishError, Settings, Unroutable
from broker_svc.spool.segment import segment_paths
from broker_svc.spool.stats import spool_collector
from broker_svc.wire.task.task_message import RESENT_HEADER
from tests.infra.node_setup import find_free_amqp_port
from tests.support.amqp import drain, queue_depth
from tests.support.workers import ROOT, WorkerProcess

ADD = "tests.integration.e2e_tasks.add"


@pytest.fixture
def spool_app(test_vhost_url: str, tmp_path: Path) -> Iterator[App]:
    app = App("spooled", settings=Settings(broker_url=test_vhost_url, spool_dir=str(tmp_path / "spool")))
    yield app
    app.close(timeout=10)


def test_tasks_sent_through_the_spool_run_and_return_their_results(
    spool_app: App, worker: WorkerProcess, queue: str, tmp_path: Path
):
    results = [spool_app.send_task(ADD, (n, n), queue=queue) for n in range(200)]
    assert [r.get(timeout=60) for r in results] == [2 * n for n in range(200)]
    spool_app.flush(timeout=30)
    stats = spool_app.spool_stats()
    assert stats is not None and stats.depth == 0 and stats.published == 200 and stats.failed == 0
    registry = CollectorRegistry()
    registry.register(spool_collector(spool_app.spool_stats, app="spooled"))  # type: ignore[arg-type]
    scraped = generate_latest(registry).decode()
    assert 'clockwork_spool_published_total{app="spooled"} 200.0' in scraped
    assert 'clockwork_spool_depth{app="spooled"} 0.0' in scraped
    slot = Path(stats.directory)
    spool_app.close(timeout=10)
    assert segment_paths(slot) == []  # all confirmed: nothing left on disk


def test_a_batch_goes_out_at_the_end_of_its_block_with_one_wait(client: App, test_vhost_url: str, queue: str):
    with client.batch() as batch:
        for n in range(300):
            client.send_task(ADD, (n, 1), queue=queue, ignore_result=True)
        client.send_many([client.signature(ADD, (0, 0), queue=queue, ignore_result=True)] * 2)
        assert len(batch) == 302
        with pytest.raises(Exception):  # noqa: B017 - nothing declared it yet: nothing was sent
            queue_depth(test_vhost_url, queue)
    # Confirmed at the block's end, so already in the queue.
    assert queue_depth(test_vhost_url, queue) == 302
    assert len(batch.results) == 302 and all(r.publish_error is None for r in batch.results)


def test_a_batch_that_raises_sends_nothing_and_its_results_say_so(
    client: App, test_vhost_url: str, queue: str
):
    client.send_task(ADD, (1, 1), queue=queue, ignore_result=True)
    client.flush(timeout=10)
    with pytest.raises(KeyError), client.batch() as batch:
        client.send_task(ADD, (2, 2), queue=queue)
        raise KeyError("abandon")
    assert queue_depth(test_vhost_url, queue) == 1
    with pytest.raises(PublishError, match="KeyError"):
        batch.results[0].get(timeout=5)


def test_send_many_with_wait_returns_once_the_broker_has_them(client: App, test_vhost_url: str, queue: str):
    signatures = [client.signature(ADD, (n, n), queue=queue, ignore_result=True) for n in range(500)]
    client.send_many(signatures, wait=True)
    assert queue_depth(test_vhost_url, queue) == 500


def test_a_spooled_batch_is_written_once_at_its_end(spool_app: App, worker: WorkerProcess, queue: str):
    with spool_app.batch() as batch:
        for n in range(100):
            spool_app.send_task(ADD, (n, 0), queue=queue)
    stats = spool_app.spool_stats()
    assert stats is not None and stats.accepted == 100 and stats.buffered == 0  # on disk or confirmed
    assert [r.get(timeout=60) for r in batch.results] == list(range(100))


def test_a_task_the_broker_refuses_for_good_fails_its_result_and_the_rest_go_on(spool_app: App, queue: str):
    refused = spool_app.send_task(ADD, (1, 1), queue="nowhere", exchange="clockwork-no-such-exchange")
    fine = [spool_app.send_task(ADD, (n, 0), queue=queue, ignore_result=True) for n in range(50)]
    with pytest.raises(Unroutable, match="no exchange"):
        refused.get(timeout=30)
    spool_app.flush(timeout=30)
    stats = spool_app.spool_stats()
    assert stats is not None and stats.failed == 1 and stats.published == 50
    assert all(r.publish_error is None for r in fine)


def _producer(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.spool_producer", *args],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def _kill_when(producer: subprocess.Popen[str], line: str) -> None:
    assert producer.stdout is not None
    try:
        assert producer.stdout.readline().strip() == line  # the producer's timeouts bound this
    finally:
        producer.send_signal(signal.SIGKILL)
        producer.wait(30)
        producer.stdout.close()


def test_what_a_killed_producer_spooled_while_the_broker_was_unreachable_is_sent_by_its_successor(
    test_vhost_url: str, queue: str, tmp_path: Path
):
    spool_dir = str(tmp_path / "spool")
    record = tmp_path / "published.jsonl"
    dead = f"amqp://guest:guest@127.0.0.1:{find_free_amqp_port()}/"
    producer = _producer("--url", dead, "--spool-dir", spool_dir, "--queue", queue, "--count", "500",
                         "--record", str(record), "--then", "written", "--task", ADD)  # fmt: skip
    _kill_when(producer, "written")
    successor = App("successor", settings=Settings(broker_url=test_vhost_url, spool_dir=spool_dir))
    try:
        assert successor.spool_stats() is None  # opened by connect() or the first send, not before
        successor.connect()
        successor.flush(timeout=60)  # what the spool held at connect() included
        stats = successor.spool_stats()
        assert stats is not None and stats.replayed == 500
    finally:
        successor.close(timeout=10)
    got = drain(test_vhost_url, queue)
    copies = collections.Counter(str(m.headers["id"]) for m in got)
    accepted = {line.split('"')[3] for line in record.read_text().splitlines() if "true" in line}
    assert len(accepted) == 500 and accepted <= copies.keys()
    replayed = [m for m in got if str(m.headers["id"]) in accepted]
    assert all(m.headers.get(RESENT_HEADER) for m in replayed)  # a predecessor's: marked


def test_a_producer_killed_while_draining_is_finished_by_its_successor_with_marked_duplicates(
    test_vhost_url: str, queue: str, tmp_path: Path
):
    spool_dir = str(tmp_path / "spool")
    record = tmp_path / "published.jsonl"
    count = 20_000
    producer = _producer("--url", test_vhost_url, "--spool-dir", spool_dir, "--queue", queue,
                         "--count", str(count), "--batch", "--record", str(record), "--then", "published",
                         "--published", str(count // 10), "--task", ADD)  # fmt: skip
    _kill_when(producer, "published")
    before = queue_depth(test_vhost_url, queue)
    successor = App("successor", settings=Settings(broker_url=test_vhost_url, spool_dir=spool_dir))
    try:
        successor.connect()  # opens the spool: the replay starts
        successor.flush(timeout=120)
        stats = successor.spool_stats()
        assert stats is not None
        replayed = stats.replayed
    finally:
        successor.close(timeout=10)
    got = drain(test_vhost_url, queue)
    copies = collections.Counter(str(m.headers["id"]) for m in got)
    unmarked = collections.Counter(str(m.headers["id"]) for m in got if not m.headers.get(RESENT_HEADER))
    duplicates = sum(n - 1 for n in copies.values())
    print(f"before the kill {before}, replayed {replayed}, in queue {len(got)}, duplicates {duplicates}")
    assert 0 < replayed <= count and len(copies) == count  # none lost
    assert all(n <= 1 for n in unmarked.values())  # every copy beyond the first is marked
    # Only replayed tasks can repeat. (What the killed process had written to its socket still
    # reaches the broker after the kill, so ``before`` is no bound.)
    assert duplicates <= replayed
