"""``--autoscale MAX,MIN`` and the pool commands against a real worker and broker.

The pool grows while tasks wait for a child, shrinks after ``--autoscale-keepalive`` seconds of
spare children, and the broker-side per-consumer prefetch (``rabbitmqctl list_consumers``)
follows its size. ``pool_grow``, ``pool_shrink`` and ``autoscale`` answer in Celery's shapes.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc import App, Settings, Signature
from tests.infra.session_broker import SessionBroker
from tests.integration.test_ctl import ctl, output
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess
from worker.pool.autoscale import TICK_S

pytestmark = pytest.mark.timeout(90)

TIMED = "tests.integration.e2e_tasks.timed"
KEEPALIVE_S = 2.0
# Measured here: the pool reached 4 children 0.56-0.65 s after 40 tasks were sent (two looks of
# the autoscaler: 1 delivery waited, then 2 more from the re-subscribed consumer), and was back at
# 1 child 2.0-2.5 s after the client had the last result (a child is spare from the moment the
# last task starts elsewhere; keepalive 2 s, then one child per 0.5 s look).
GROW_BOUND_S = 3.0
SHRINK_BOUND_S = KEEPALIVE_S + 2.0


@pytest.fixture
def scaled(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    # The worker-consumes design's prefetch headroom (consuming children: test_children_autoscale.py).
    args = ["--worker-consumes", "--autoscale", "4,1", "--autoscale-keepalive", str(KEEPALIVE_S)]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=args) as proc:
        yield proc.wait_ready()


@pytest.fixture
def fixed(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    args = ["--worker-consumes"]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=args) as proc:
        yield proc.wait_ready()


def prefetches(broker: SessionBroker, url: str, queue: str) -> list[int]:
    """The prefetch of each consumer of ``queue``, as the broker sees it."""
    ctl = broker.rabbitmqctl
    if ctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to read the consumers' prefetch)")
    vhost = Settings(broker_url=url).virtual_host
    out = ctl("list_consumers", "-p", vhost, "--no-table-headers", "--quiet", "queue_name", "prefetch_count")
    # Only the table's rows: rabbitmqctl may print a line of its own among them (seen once in CI).
    rows = [line.split("\t") for line in out.splitlines() if line.count("\t") == 1]
    return [int(count) for name, count in rows if name == queue]


def stats(client: App, node: WorkerProcess) -> dict[str, Any]:
    value = client.control.inspect(destination=node.name, timeout=5).stats()
    assert isinstance(value, dict), value
    return value


def command(client: App, node: WorkerProcess, name: str, **arguments: Any) -> Any:
    """Send a control command to ``node`` with a reply; its reply value."""
    replies = getattr(client.control, name)(**arguments, destination=[node.name], reply=True, timeout=5)
    assert replies is not None and len(replies) == 1, replies
    return replies[0][node.name]


def logged(node: WorkerProcess, event: str, **fields: Any) -> list[dict[str, Any]]:
    return [
        e for e in node.events() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
    ]


def peak_overlap(spans: list[list[float]]) -> int:
    """How many of the ``[start, end]`` spans ran at the same moment, at most."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, step in edges:
        running += step
        peak = max(peak, running)
    return peak


def test_a_backlog_grows_the_pool_to_max_and_idleness_shrinks_it_back_to_min(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App, scaled: WorkerProcess
) -> None:
    before = stats(client, scaled)
    assert before["autoscaler"] == {"max": 4, "min": 1, "current": 1, "qty": 0}
    assert before["pool"]["max-concurrency"] == 1 and len(before["pool"]["processes"]) == 1
    # Below MAX the prefetch keeps one delivery of headroom: how a backlog becomes visible.
    assert before["prefetch_count"] == 2
    assert prefetches(session_broker, test_vhost_url, queue) == [2]

    sent = time.monotonic()
    results = client.send_many(Signature(TIMED, (0.5,), {}, {"queue": queue}) for _ in range(40))
    wait_for(lambda: logged(scaled, "autoscale_grow", new_size=4), timeout_s=GROW_BOUND_S,
             message=f"the pool did not reach 4 children:\n{scaled.log_text()[-3000:]}")  # fmt: skip
    grow_s = time.monotonic() - sent
    # At MAX, no headroom: the broker-side prefetch is 4 per consumer (re-subscribed, not global).
    wait_for(lambda: prefetches(session_broker, test_vhost_url, queue) == [4], timeout_s=5, interval_s=0.1,
             message="the consumer's prefetch did not follow the pool to 4")  # fmt: skip
    during = stats(client, scaled)
    assert during["autoscaler"]["current"] == 4 and during["pool"]["max-concurrency"] == 4
    assert during["prefetch_count"] == 4

    spans = [result.get(timeout=30) for result in results]
    done = time.monotonic()
    assert len(spans) == 40
    assert peak_overlap(spans) == 4  # never more children than MAX
    wait_for(lambda: logged(scaled, "autoscale_shrink", new_size=1), timeout_s=SHRINK_BOUND_S,
             message=f"the pool did not shrink back to 1:\n{scaled.log_text()[-3000:]}")  # fmt: skip
    shrink_s = time.monotonic() - done
    print(f"\nautoscale: 1 -> 4 children in {grow_s:.2f} s; 4 -> 1 {shrink_s:.2f} s after the last task")

    grows = [(e["old_size"], e["new_size"]) for e in logged(scaled, "autoscale_grow")]
    shrinks = [(e["old_size"], e["new_size"]) for e in logged(scaled, "autoscale_shrink")]
    assert grows[0][0] == 1 and grows[-1][1] == 4 and all(a < b for a, b in grows), grows
    assert shrinks == [(4, 3), (3, 2), (2, 1)]  # one child per look once keepalive passed
    # Nothing shrank before a child had been spare for the keepalive: not before the last task
    # left the waiting line (it started), give or take one look of the autoscaler.
    first_shrink = dt.datetime.fromisoformat(logged(scaled, "autoscale_shrink")[0]["timestamp"]).timestamp()
    assert first_shrink >= max(start for start, _ in spans) + KEEPALIVE_S - TICK_S - 0.05
    after = stats(client, scaled)
    assert after["autoscaler"] == {"max": 4, "min": 1, "current": 1, "qty": 0}
    assert after["pool"]["max-concurrency"] == 1 and len(after["pool"]["processes"]) == 1
    assert after["prefetch_count"] == 2
    assert prefetches(session_broker, test_vhost_url, queue) == [2]


def test_the_autoscale_command_moves_the_range_and_pool_grow_and_shrink_are_refused(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App, scaled: WorkerProcess
) -> None:
    assert command(client, scaled, "pool_grow", n=1) == {
        "error": "pool_grow is not supported with autoscale. Adjust autoscale range instead."
    }
    assert command(client, scaled, "pool_shrink", n=1) == {
        "error": "pool_shrink is not supported with autoscale. Adjust autoscale range instead."
    }

    # A higher minimum grows the pool at once.
    assert command(client, scaled, "autoscale", max=6, min=3) == {"ok": "autoscale now max=6 min=3"}
    now = stats(client, scaled)
    assert now["autoscaler"] == {"max": 6, "min": 3, "current": 3, "qty": 0}
    assert now["prefetch_count"] == 4  # 3 children + 1 of headroom
    wait_for(lambda: len(stats(client, scaled)["pool"]["processes"]) == 3, timeout_s=10,
             message="three children")  # fmt: skip
    assert prefetches(session_broker, test_vhost_url, queue) == [4]

    # A lower maximum shrinks it at once (idle children); at MAX there is no headroom.
    assert command(client, scaled, "autoscale", max=2, min=1) == {"ok": "autoscale now max=2 min=1"}
    now = stats(client, scaled)
    assert now["autoscaler"]["current"] == 2 and len(now["pool"]["processes"]) == 2
    assert now["prefetch_count"] == 2
    assert prefetches(session_broker, test_vhost_url, queue) == [2]

    # One bound alone keeps the other; a range that makes no sense is refused as Celery refuses.
    assert command(client, scaled, "autoscale", max=5, min=None) == {"ok": "autoscale now max=5 min=1"}
    refused = command(client, scaled, "autoscale", max=1, min=2)
    assert refused == {"error": "ValueError('autoscale needs max >= 1 and 0 <= min <= max, got max=1 min=2')"}


def test_pool_grow_and_shrink_resize_a_fixed_pool_and_its_prefetch(
    session_broker: SessionBroker, test_vhost_url: str, queue: str, client: App, fixed: WorkerProcess
) -> None:
    assert "autoscaler" not in stats(client, fixed)
    assert command(client, fixed, "autoscale", max=4, min=1) == {
        "error": "ValueError('Autoscale not enabled')"
    }

    assert command(client, fixed, "pool_grow", n=2) == {"ok": "pool will grow"}
    wait_for(
        lambda: len(stats(client, fixed)["pool"]["processes"]) == 3, timeout_s=10, message="three children"
    )
    now = stats(client, fixed)
    assert now["pool"]["max-concurrency"] == 3 and now["prefetch_count"] == 3
    assert prefetches(session_broker, test_vhost_url, queue) == [3]
    # The three children run three tasks side by side.
    spans = [r.get(timeout=30) for r in [client.send_task(TIMED, (0.5,), queue=queue) for _ in range(3)]]
    assert peak_overlap(spans) == 3

    # The ctl console script sends the same command.
    proc, _ = ctl(
        "control", "pool-shrink", "2", "-b", test_vhost_url, "-d", fixed.name, "--json", "--timeout", "5"
    )
    assert proc.returncode == 0, output(proc)
    assert json.loads(proc.stdout) == {fixed.name: {"ok": "pool will shrink"}}
    now = stats(client, fixed)
    assert now["pool"]["max-concurrency"] == 1 and len(now["pool"]["processes"]) == 1
    assert now["prefetch_count"] == 1
    assert prefetches(session_broker, test_vhost_url, queue) == [1]
    assert command(client, fixed, "pool_shrink") == {
        "error": 'ValueError("Can\'t shrink the pool below one process")'
    }
    assert client.send_task(TIMED, (0.01,), queue=queue).get(timeout=30)
