"""``--autoscale``, ``pool_grow`` and ``pool_shrink``: each child is a consumer of its own.

The pool grows while every child is busy and the queue holds ready messages, and shrinks back to
MIN after ``--autoscale-keepalive`` seconds of spare children. Each child consumes at the spec's
prefetch from start to exit (``rabbitmqctl list_consumers`` shows one consumer per child), so the
worker's consumers follow the size without any re-subscribe. A child the pool retires stops
consuming, hands back what it prefetched, ends its task and exits: every task runs exactly once
(``recorded`` notes each run's id in a file as it starts).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App
from tests.infra.session_broker import SessionBroker
from tests.integration.test_autoscale import command, logged, peak_overlap, prefetches, stats
from tests.integration.test_ctl import ctl, output
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.timeout(120)

TASKS = "tests.integration.semantics_tasks"
RECORDED = f"{TASKS}.recorded"
KEEPALIVE_S = 2.0
# Children fork from the forkserver and each connects on its own: a few tenths of a second each
# here; the bounds leave room for a machine shared with the broker and other test runs.
GROW_BOUND_S = 10.0
SHRINK_BOUND_S = KEEPALIVE_S + 10.0
CHILDREN = ["--without-mingle"]


def feed_worker(url: str, queue: str, *, concurrency: int, args: list[str]) -> WorkerProcess:
    return WorkerProcess(url, app=f"{TASKS}:app", queues=[queue], concurrency=concurrency,
                         extra_args=[*CHILDREN, *args])  # fmt: skip


@pytest.fixture
def scaled(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    args = ["--autoscale", "4,1", "--autoscale-keepalive", str(KEEPALIVE_S)]
    with feed_worker(test_vhost_url, queue, concurrency=1, args=args) as proc:
        yield proc.wait_ready()


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    return tmp_path / "runs.jsonl"


def started_ids(path: Path) -> Counter[str]:
    """How many times each task id started, from the file ``recorded`` appends to."""
    if not path.exists():
        return Counter()
    return Counter(json.loads(line)["id"] for line in path.read_text().splitlines())


def processes(client: App, node: WorkerProcess) -> int:
    return len(stats(client, node)["pool"]["processes"])


def consumers_are(broker: SessionBroker, url: str, queue: str, expected: list[int], why: str) -> None:
    """Wait until the broker shows ``queue``'s consumers with these prefetches (one per child)."""
    wait_for(lambda: sorted(prefetches(broker, url, queue)) == expected, timeout_s=GROW_BOUND_S,
             interval_s=0.2, message=f"{why}: consumers {prefetches(broker, url, queue)}")  # fmt: skip


def test_a_backlog_grows_the_consuming_children_to_max_and_idleness_shrinks_them_to_min(
    session_broker: SessionBroker,
    test_vhost_url: str,
    queue: str,
    client: App,
    scaled: WorkerProcess,
    runs: Path,
) -> None:
    before = stats(client, scaled)
    assert before["autoscaler"] == {"max": 4, "min": 1, "current": 1, "qty": 0}
    assert before["pool"]["max-concurrency"] == 1 and len(before["pool"]["processes"]) == 1
    # The child's own prefetch: no headroom (the backlog shows in the queue, not in the worker).
    assert before["prefetch_count"] == 1
    consumers_are(session_broker, test_vhost_url, queue, [1], "one child consumes")

    sent = time.monotonic()
    results = [client.send_task(RECORDED, (str(runs), 0.5), queue=queue) for _ in range(40)]
    wait_for(lambda: logged(scaled, "autoscale_grow", new_size=4), timeout_s=GROW_BOUND_S,
             message=f"the pool did not reach 4 children:\n{scaled.log_text()[-3000:]}")  # fmt: skip
    grow_s = time.monotonic() - sent
    # Four consumers at prefetch 1 each: every new child brought its own, nobody re-subscribed.
    consumers_are(session_broker, test_vhost_url, queue, [1, 1, 1, 1], "four children consume")
    during = stats(client, scaled)
    assert during["autoscaler"]["current"] == 4 and during["pool"]["max-concurrency"] == 4
    assert during["prefetch_count"] == 4 and len(during["pool"]["processes"]) == 4

    spans = [result.get(timeout=60) for result in results]
    done = time.monotonic()
    assert peak_overlap(spans) == 4  # four children ran side by side, never more than MAX
    wait_for(lambda: logged(scaled, "autoscale_shrink", new_size=1), timeout_s=SHRINK_BOUND_S,
             message=f"the pool did not shrink back to 1:\n{scaled.log_text()[-3000:]}")  # fmt: skip
    shrink_s = time.monotonic() - done
    print(f"\nchildren autoscale: 1 -> 4 in {grow_s:.2f} s; 4 -> 1 {shrink_s:.2f} s after the last task")
    consumers_are(session_broker, test_vhost_url, queue, [1], "one child left")
    wait_for(lambda: processes(client, scaled) == 1, timeout_s=10, message="one child in stats")

    grows = [(e["old_size"], e["new_size"]) for e in logged(scaled, "autoscale_grow")]
    shrinks = [(e["old_size"], e["new_size"]) for e in logged(scaled, "autoscale_shrink")]
    assert grows[0][0] == 1 and grows[-1][1] == 4 and all(a < b for a, b in grows), grows
    assert shrinks == [(4, 3), (3, 2), (2, 1)]  # one child per look once keepalive passed
    assert len(logged(scaled, "pool_child_retiring")) == 3
    after = stats(client, scaled)
    assert after["autoscaler"] == {"max": 4, "min": 1, "current": 1, "qty": 0}
    assert after["pool"]["max-concurrency"] == 1 and after["prefetch_count"] == 1
    assert started_ids(runs) == Counter({result.id: 1 for result in results})  # each ran once
    text = scaled.log_text()
    assert "pool_child_died_idle" not in text and "pool_child_start_failed" not in text

    # The autoscale command moves the range: a higher minimum grows the children at once.
    assert command(client, scaled, "autoscale", max=3, min=2) == {"ok": "autoscale now max=3 min=2"}
    assert stats(client, scaled)["autoscaler"] == {"max": 3, "min": 2, "current": 2, "qty": 0}
    consumers_are(session_broker, test_vhost_url, queue, [1, 1], "two children after autoscale 3,2")


def test_pool_grow_and_shrink_resize_the_consuming_children(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App, runs: Path
) -> None:
    with feed_worker(test_vhost_url, queue, concurrency=1, args=[]) as node:
        node.wait_ready()
        assert "autoscaler" not in stats(client, node)
        assert command(client, node, "autoscale", max=4, min=1) == {
            "error": "ValueError('Autoscale not enabled')"
        }

        # Past the start-up size: the board of what each child runs grows with the pool.
        assert command(client, node, "pool_grow", n=2) == {"ok": "pool will grow"}
        consumers_are(session_broker, test_vhost_url, queue, [1, 1, 1], "three children consume")
        wait_for(lambda: processes(client, node) == 3, timeout_s=10, message="three children in stats")
        now = stats(client, node)
        assert now["pool"]["max-concurrency"] == 3 and now["prefetch_count"] == 3
        results = [client.send_task(RECORDED, (str(runs), 1.0), queue=queue) for _ in range(3)]
        assert peak_overlap([r.get(timeout=30) for r in results]) == 3  # side by side, one per child
        running = {json.loads(line)["pid"] for line in runs.read_text().splitlines()}
        assert len(running) == 3 and node.pid not in running

        # The ctl console script sends the same command; the children go, not their slots' successors.
        proc, _ = ctl(
            "control", "pool-shrink", "2", "-b", test_vhost_url, "-d", node.name, "--json", "--timeout", "5"
        )
        assert proc.returncode == 0, output(proc)
        assert json.loads(proc.stdout) == {node.name: {"ok": "pool will shrink"}}
        now = stats(client, node)
        assert now["pool"]["max-concurrency"] == 1 and now["prefetch_count"] == 1
        consumers_are(session_broker, test_vhost_url, queue, [1], "one child left")
        wait_for(lambda: processes(client, node) == 1, timeout_s=10, message="one child in stats")
        assert command(client, node, "pool_shrink") == {
            "error": 'ValueError("Can\'t shrink the pool below one process")'
        }
        assert client.send_task(RECORDED, (str(runs), 0.0), queue=queue).get(timeout=30)
        assert node.count("pool_child_retiring") == 2
        assert "pool_child_died_idle" not in node.log_text()


@pytest.mark.parametrize("threads", [1, 2])
def test_a_child_retired_while_busy_ends_its_tasks_and_hands_back_what_it_prefetched(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App, runs: Path, threads: int
) -> None:
    # Prefetch 2 per thread: each busy child (one consumer, its threads sharing it) holds a
    # delivery per thread it has not started, which it must hand back when it retires (neither run
    # it nor drop it).
    args = ["--prefetch-multiplier", "2", "--threads", str(threads)]
    with feed_worker(test_vhost_url, queue, concurrency=3, args=args) as node:
        node.wait_ready()
        consumers_are(session_broker, test_vhost_url, queue, [2 * threads] * 3, "every child consumes")
        results = [client.send_task(RECORDED, (str(runs), 0.4), queue=queue) for _ in range(24 * threads)]

        def all_busy() -> bool:
            replies = client.control.inspect(destination=[node.name], timeout=5).active() or {}
            return len(replies.get(node.name) or []) == 3 * threads

        wait_for(all_busy, timeout_s=20, message="every thread runs a task")
        assert command(client, node, "pool_shrink", n=2) == {"ok": "pool will shrink"}
        retiring = logged(node, "pool_child_retiring")
        assert len(retiring) == 2 and all(e["busy"] for e in retiring), retiring
        now = stats(client, node)
        assert now["pool"]["max-concurrency"] == 1 and now["prefetch_count"] == 2 * threads

        # Every task succeeded, those the retiring children were running included.
        spans: list[Any] = [result.get(timeout=60) for result in results]
        assert len(spans) == 24 * threads
        # Each task started exactly once: none dropped, none run twice (a handed-back delivery
        # comes again as a copy and runs once, elsewhere).
        assert started_ids(runs) == Counter({result.id: 1 for result in results})
        consumers_are(session_broker, test_vhost_url, queue, [2 * threads], "one child left")
        # The hand-back was exercised, and counted no delivery: what a retiring child held went
        # back as copies carrying their counts, not as redeliveries.
        assert node.count("task_requeued_on_shutdown") >= 1
        assert node.count("task_redelivery_counted") == 0
        assert "pool_child_died_idle" not in node.log_text()
