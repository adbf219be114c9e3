"""Rate limits: the observed start rate is within 10 % of the limit, other tasks are not held up,
and the limit changes at runtime with the ``rate_limit`` command."""

from __future__ import annotations

import time

from broker_svc import App
from tests.support.pidbox import call
from tests.support.workers import WorkerProcess

LIMITED = "tests.integration.e2e_tasks.limited"
ADD = "tests.integration.e2e_tasks.add"


def _rate(starts: list[float]) -> float:
    starts = sorted(starts)
    return (len(starts) - 1) / (starts[-1] - starts[0])


def test_a_rate_limited_task_runs_at_its_rate_and_does_not_block_others(
    test_vhost_url: str, queue: str, client: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        sent = time.time()
        limited = [client.send_task(LIMITED, queue=queue) for _ in range(30)]
        adds = [client.send_task(ADD, args=(i, i), queue=queue) for i in range(20)]
        assert [r.get(timeout=30) for r in adds] == [2 * i for i in range(20)]
        adds_done = time.time()
        starts = [r.get(timeout=30) for r in limited]
        # 30 tasks at 10/s take about 2.9 s; the unlimited ones did not wait for them.
        assert adds_done - sent < 1.5, adds_done - sent
        assert 9.0 <= _rate(starts) <= 11.0, _rate(starts)

        replies = call(
            test_vhost_url, "rate_limit", arguments={"task_name": LIMITED, "rate_limit": "20/s"},
            destination=[worker.name], expect=1,
        )  # fmt: skip
        assert replies[0][1] == {worker.name: {"ok": "new rate limit set successfully"}}
        faster = [r.get(timeout=30) for r in [client.send_task(LIMITED, queue=queue) for _ in range(40)]]
        assert 18.0 <= _rate(faster) <= 22.0, _rate(faster)

        replies = call(
            test_vhost_url, "rate_limit", arguments={"task_name": LIMITED, "rate_limit": None},
            destination=[worker.name], expect=1,
        )  # fmt: skip
        assert replies[0][1] == {worker.name: {"ok": "rate limit disabled successfully"}}
        unlimited = [r.get(timeout=30) for r in [client.send_task(LIMITED, queue=queue) for _ in range(30)]]
        assert _rate(unlimited) > 30

        replies = call(
            test_vhost_url, "rate_limit", arguments={"task_name": "no.such.task", "rate_limit": "1/s"},
            destination=[worker.name], expect=1,
        )  # fmt: skip
        assert replies[0][1] == {worker.name: {"error": "unknown task"}}
