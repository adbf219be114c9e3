"""The ``autoscale`` command against a real worker and broker, and the helpers of the pool tests.

The range moves at once (the pool follows it), ``pool_grow`` and ``pool_shrink`` are refused with
autoscale, and every reply is in Celery's shape. How a backlog grows the pool and idleness shrinks
it: test_children_autoscale.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc import App, Settings
from tests.infra.session_broker import SessionBroker
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.timeout(90)

# Long: the test checks the sizes the autoscale command sets, which idleness must not change meanwhile.
KEEPALIVE_S = 300.0


@pytest.fixture
def scaled(test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    args = ["--autoscale", "4,1", "--autoscale-keepalive", str(KEEPALIVE_S)]
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
    assert now["prefetch_count"] == 3  # each child its own prefetch of 1: no headroom needed
    wait_for(lambda: len(stats(client, scaled)["pool"]["processes"]) == 3, timeout_s=10,
             message="three children")  # fmt: skip
    wait_for(lambda: prefetches(session_broker, test_vhost_url, queue) == [1, 1, 1], timeout_s=30,
             message="a consumer of prefetch 1 for each of three children")  # fmt: skip

    # A lower maximum shrinks it at once (idle children retire).
    assert command(client, scaled, "autoscale", max=2, min=1) == {"ok": "autoscale now max=2 min=1"}
    now = stats(client, scaled)
    assert now["autoscaler"]["current"] == 2 and len(now["pool"]["processes"]) == 2
    assert now["prefetch_count"] == 2
    wait_for(lambda: prefetches(session_broker, test_vhost_url, queue) == [1, 1], timeout_s=30,
             message="the retired child's consumer gone")  # fmt: skip

    # One bound alone keeps the other; a range that makes no sense is refused as Celery refuses.
    assert command(client, scaled, "autoscale", max=5, min=None) == {"ok": "autoscale now max=5 min=1"}
    refused = command(client, scaled, "autoscale", max=1, min=2)
    assert refused == {"error": "ValueError('autoscale needs max >= 1 and 0 <= min <= max, got max=1 min=2')"}
