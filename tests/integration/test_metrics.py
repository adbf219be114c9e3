"""A worker's /metrics, scraped during and after a drain: celery-exporter's names, counts that add up."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker_svc import App, Settings
from tests.support.amqp import delete_queues
from tests.support.metrics import free_port, scrape
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

ADD = "tests.integration.e2e_tasks.add"
COUNT = 200


def value(samples: dict, metric: str, **labels: str) -> float:
    """The sum of ``metric``'s samples whose labels include ``labels``."""
    return float(sum(v for (n, ls), v in samples.items() if n == metric and set(labels.items()) <= set(ls)))


@pytest.fixture
def metered(test_vhost_url: str) -> Iterator[tuple[WorkerProcess, int, str]]:
    queue, port = unique_queue("metrics"), free_port()
    args = ["--metrics-port", str(port), "--metrics-address", "127.0.0.1"]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2, extra_args=args) as worker:
        worker.wait_ready()
        yield worker, port, queue
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_metrics_count_a_drain_under_celery_exporters_names(test_vhost_url: str, metered):
    worker, port, queue = metered
    host = worker.name.rpartition("@")[2]
    app = App("metrics-client", settings=Settings(broker_url=test_vhost_url, default_queue=queue))
    try:
        results = app.send_many(app.signature(ADD, (i, i)) for i in range(COUNT))
        failing = app.send_task(ADD, ("x", 1))  # TypeError in the task
        app.send_task("no.such.task")
        # Scraped while it drains: counts only grow, and never pass what was sent.
        seen = []

        def drained() -> bool:
            samples = scrape(port)
            seen.append(value(samples, "celery_task_succeeded_total", name=ADD))
            return seen[-1] >= COUNT

        wait_for(drained, timeout_s=120, interval_s=0.05, message=f"not drained: {seen[-3:]}")
        assert seen == sorted(seen) and seen[-1] == COUNT
        assert [r.get(timeout=30) for r in results[:3]] == [0, 2, 4]
        with pytest.raises(TypeError):
            failing.get(timeout=30)
        samples = scrape(port)
        labels = {"name": ADD, "hostname": host, "queue_name": queue}
        assert value(samples, "celery_task_received_total", **labels) == COUNT + 1
        assert value(samples, "celery_task_started_total", **labels) == COUNT + 1
        assert value(samples, "celery_task_failed_total", exception="TypeError", **labels) == 1
        assert value(samples, "celery_task_runtime_count", **labels) == COUNT + 1
        assert value(samples, "celery_worker_up", hostname=host) == 1
        assert value(samples, "celery_worker_tasks_active", hostname=host) == 0
        assert value(samples, "clockwork_pool_processes", hostname=host, state="idle") == 2
        assert value(samples, "clockwork_dead_letters_total", queue_name=queue, reason="NotRegistered") == 1
        # Every result the worker (or its consuming children) published was confirmed, and timed.
        assert value(samples, "clockwork_publish_confirm_seconds_count", kind="result") >= COUNT
        # The queue's depth is sampled in the background: drained now, with our consumers (one
        # per consuming child, or the worker's one).
        consumers = 2
        wait_for(
            lambda: value(scrape(port), "clockwork_queue_consumers", queue_name=queue) == consumers,
            timeout_s=30,
            message="queue depth not sampled",
        )
        assert value(scrape(port), "clockwork_queue_messages", queue_name=queue) == 0
    finally:
        app.close()


def test_the_shipped_grafana_dashboard_reads_only_metrics_a_worker_serves(metered):
    """docs/grafana/clockwork-workers.json: every metric its queries name is one we export."""
    _, port, _ = metered
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    # Every series name a family can have (a counter with no sample yet still declares its family).
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    served = {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in suffixes.get(family.type, [""])
    }
    dashboard = json.loads((ROOT / "docs" / "grafana" / "clockwork-workers.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\b((?:celery|clockwork)_[a-z_]+)", e)}
    assert named, exprs
    missing = named - served
    assert not missing, f"the dashboard reads metrics no worker serves: {sorted(missing)}"
