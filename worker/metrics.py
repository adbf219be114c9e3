"""A worker's Prometheus metrics, under celery-exporter's names and labels, served on ``--metrics-port``.

Dashboards and alerts built for celery-exporter (Grafana 17508/17509, the celery-mixin) read these
unchanged: ``celery_task_{received,started,succeeded,failed,retried,rejected,revoked}_total`` with
``name``, ``hostname`` (the host part of the node name, as celery-exporter shortens it) and
``queue_name`` (``failed`` adds ``exception``), the ``celery_task_runtime`` histogram, and
``celery_worker_up`` / ``celery_worker_tasks_active`` per ``hostname``. Unlike celery-exporter they
need no events and no separate process: each worker serves its own, and Prometheus sums them.

Ours, under ``clockwork_``: dead letters by queue and reason, requeued dead letters by how they
ended (``ctl dead requeue`` runs in a short-lived process: its copies are counted where they end),
redeliveries, the pool's children (busy or idle), each consumed queue's depth and consumers
(sampled every 15 s), and how long the broker takes to confirm what the worker publishes. One
registry in the worker's main process is the whole count: the pool children count their own tasks
and send their counts in batches (``worker/consume/tally.py``), added here by
:meth:`WorkerMetrics.add`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Final

import aio_pika.abc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.consume.tally import Tally

__all__ = ["WorkerMetrics"]

_TASK_LABELS: Final = ("name", "hostname", "queue_name")
# celery-exporter's default buckets are Prometheus's; tasks here run from microseconds to hours.
_RUNTIME_BUCKETS: Final = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
    900,
    3600,
)


class WorkerMetrics:
    """The counters and gauges of one worker, in a registry of their own.

    Args:
        nodename: the worker's node name (``w1@host``); labels carry its host part.
        pool_size: the pool's current size (read at each scrape).
        busy: how many children run a task now (read at each scrape).
    """

    def __init__(self, nodename: str, *, pool_size: Callable[[], int], busy: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.hostname = nodename.rpartition("@")[2] or nodename
        registry = self.registry

        def counter(event: str, text: str, *extra: str) -> Counter:
            labels = (*_TASK_LABELS[:2], *extra, _TASK_LABELS[2])
            return Counter(f"celery_task_{event}", text, labels, registry=registry)

        self._received = counter("received", "Tasks the worker received.")
        self._started = counter("started", "Tasks the worker started.")
        self._succeeded = counter("succeeded", "Tasks that succeeded.")
        self._failed = counter("failed", "Tasks that failed for good.", "exception")
        self._retried = counter("retried", "Tasks that failed and will be retried.")
        self._rejected = counter("rejected", "Tasks rejected (Reject), to be requeued or dead-lettered.")
        self._revoked = counter("revoked", "Tasks revoked or expired, and running tasks terminated.")
        self._runtime = Histogram(
            "celery_task_runtime", "Task runtime in seconds.", _TASK_LABELS, registry=registry,
            buckets=_RUNTIME_BUCKETS,
        )  # fmt: skip
        self._up = Gauge("celery_worker_up", "1 while the worker runs.", ("hostname",), registry=registry)
        self._dead = Counter(
            "clockwork_dead_letters", "Deliveries kept in <queue>.dead, by reason.",
            ("hostname", "queue_name", "reason"), registry=registry,
        )  # fmt: skip
        self._requeued = Counter(
            "clockwork_requeued_tasks",
            "Requeued dead letters (x-clockwork-requeued) whose delivery ended here: done (ran, or "
            "answered unrun) or dead_lettered again. Retries and parked copies count once, at their end.",
            ("hostname", "queue_name", "outcome"), registry=registry,
        )  # fmt: skip
        self._redelivered = Counter(
            "clockwork_redeliveries", "Deliveries that were a repeat (a worker or child died, a lost ack).",
            ("hostname", "queue_name"), registry=registry,
        )  # fmt: skip
        self._queue_ready = Gauge(
            "clockwork_queue_messages", "Messages ready in a queue this worker consumes (sampled).",
            ("queue_name",), registry=registry,
        )  # fmt: skip
        self._queue_consumers = Gauge(
            "clockwork_queue_consumers", "Consumers of a queue this worker consumes (sampled).",
            ("queue_name",), registry=registry,
        )  # fmt: skip
        self._confirm = Histogram(
            "clockwork_publish_confirm_seconds",
            "Seconds from a worker's publish (result, follow-up task, dead letter, ...) to its confirm.",
            ("hostname", "kind"), registry=registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )  # fmt: skip
        self._dedup = Counter(
            "clockwork_dedup_decisions", "Keyed-dedup gate decisions (accepted, declined, evicted, ...).",
            ("hostname", "decision"), registry=registry,
        )  # fmt: skip
        self._up.labels(self.hostname).set(1)
        registry.register(_PoolCollector(self.hostname, pool_size, busy))

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``address:port`` from a thread of its own."""
        start_http_server(port, addr=address, registry=self.registry)

    def add(self, tally: Tally) -> None:
        """Counts a child reported: the celery-exporter series and ours, in a batch."""
        host = self.hostname
        by_event = {
            "received": self._received, "started": self._started, "succeeded": self._succeeded,
            "retried": self._retried, "rejected": self._rejected, "revoked": self._revoked,
        }  # fmt: skip
        for (event, *labels), n in tally.counts.items():
            if event in by_event:
                name, queue = labels
                by_event[event].labels(name, host, queue).inc(n)
            elif event == "failed":
                name, queue, exception = labels
                self._failed.labels(name, host, exception, queue).inc(n)
            elif event == "dead_lettered":
                queue, reason = labels
                self._dead.labels(host, queue, reason).inc(n)
            elif event == "redelivered":
                self._redelivered.labels(host, labels[0]).inc(n)
            elif event == "requeued":
                queue, outcome = labels
                self._requeued.labels(host, queue, outcome).inc(n)
        for (name, queue), seconds in tally.runtimes.items():
            runtime = self._runtime.labels(name, host, queue)
            for value in seconds:
                runtime.observe(value)
        for kind, seconds in tally.confirms.items():
            confirm = self._confirm.labels(host, kind)
            for value in seconds:
                confirm.observe(value)

    def queue_depth(self, queue: str, ready: int, consumers: int) -> None:
        """A sample of a consumed queue (every worker on it reports the same: take the max)."""
        self._queue_ready.labels(queue).set(ready)
        self._queue_consumers.labels(queue).set(consumers)

    async def sample_queues(
        self, connection: aio_pika.abc.AbstractConnection, queues: Callable[[], list[str]], *, every_s: float
    ) -> None:
        """Sample the depth of each consumed queue every ``every_s`` seconds; until cancelled."""
        while True:
            try:
                # A channel per round: a queue deleted meanwhile (404) closes the channel it is asked on.
                async with connection.channel(publisher_confirms=False) as channel:
                    for name in queues():
                        declared = await channel.declare_queue(name, passive=True)
                        result = declared.declaration_result
                        self.queue_depth(name, result.message_count or 0, result.consumer_count or 0)
            except Exception:
                pass
            await asyncio.sleep(every_s)

    def dedup(self, decision: str) -> None:
        """The dedup gate decided a task's fate (or a head's end) on this worker."""
        self._dedup.labels(self.hostname, decision).inc()


class _PoolCollector(Collector):
    # The pool's size and busy children, read when Prometheus scrapes.
    def __init__(self, hostname: str, size: Callable[[], int], busy: Callable[[], int]) -> None:
        self._hostname = hostname
        self._size = size
        self._busy = busy

    def describe(self) -> Iterator[GaugeMetricFamily]:
        # Registering must not read the figures: the consumer they come from may not exist yet.
        return iter(())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # Read, not counted: a gauge kept by increments would drift on a run cut short.
        active = GaugeMetricFamily(
            "celery_worker_tasks_active", "Tasks the worker runs now.", labels=["hostname"]
        )
        processes = GaugeMetricFamily(
            "clockwork_pool_processes", "Pool children, busy or idle.", labels=["hostname", "state"]
        )
        size, busy = self._size(), self._busy()
        processes.add_metric([self._hostname, "busy"], busy)
        processes.add_metric([self._hostname, "idle"], max(0, size - busy))
        active.add_metric([self._hostname], busy)
        yield active
        yield processes
