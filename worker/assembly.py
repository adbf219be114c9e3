"""What the worker service builds from its ``WorkerConfig``: the children's spec, the metrics."""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING

import structlog

from broker_svc.app import App
from broker_svc.topology import dead_letter_queue
from worker.child.spec import FeedSpec
from worker.config import WorkerConfig, time_limits_over_consumer_timeout
from worker.pool.pool import ProcessPool
from worker.rules.rate_limits import parse_rate

if TYPE_CHECKING:
    from worker.metrics import WorkerMetrics

__all__ = ["feed_spec", "serve_metrics", "warn_time_limits"]

log = structlog.get_logger(__name__)


def feed_spec(config: WorkerConfig, app: App) -> FeedSpec:
    """What each consuming child is told at start: where to connect, what to consume, its limits.

    Args:
        config: worker options.
        app: the application whose tasks the children run.

    Returns:
        The spec the pool hands each consuming child at start.
    """
    settings = config.settings
    if config.broker_heartbeat_s is not None:
        settings = dataclasses.replace(settings, heartbeat_s=config.broker_heartbeat_s)
    return FeedSpec(
        settings=settings,
        queues=config.queues,
        # As TaskQueues.declare declares them: a 406 otherwise, and a queue deleted under
        # a child must come back the same (durable, its type, its dead-letter queue, its binding).
        queue_specs=tuple(
            spec
            for queue in config.queues
            for spec in (
                dead_letter_queue(queue),
                config.settings.task_queue(queue),
            )
        ),
        prefetch=config.prefetch_multiplier,
        prefetch_budget_s=config.prefetch_budget_s,
        hostname=config.hostname,
        default_time_limits=(config.time_limit_s, config.soft_time_limit_s),
        task_events=config.task_events,
        task_names=tuple(sorted(app.tasks)),
        async_task_names=tuple(sorted(n for n, t in app.tasks.items() if inspect.iscoroutinefunction(t.run))),
        max_tasks_per_child=config.max_tasks_per_child,
        max_memory_per_child_kib=config.max_memory_per_child_kib,
        threads=config.threads,
        dedupe_window_s=config.dedupe_window_s,
        rate_limits={
            name: per_second
            for name, task in app.tasks.items()
            if (per_second := parse_rate(task.rate_limit)) is not None
        },
    )


def warn_time_limits(config: WorkerConfig, app: App) -> None:
    """Warn of each task whose time limit outlasts the broker's ``consumer_timeout``.

    Args:
        config: worker options.
        app: the application whose tasks the children run.
    """
    # The worker cannot read the broker's consumer_timeout: it is told it (--consumer-timeout).
    limits = {
        name: task.time_limit or config.time_limit_s
        for name, task in app.tasks.items()
        if not name.startswith("celery.")
    }
    over = time_limits_over_consumer_timeout(limits, consumer_timeout_s=config.consumer_timeout_s)
    for name, limit in over.items():
        log.warning(
            "time_limit_over_consumer_timeout",
            task_name=name,
            time_limit_s=limit,
            consumer_timeout_s=config.consumer_timeout_s,
            hint="the broker closes the channel of a delivery held past consumer_timeout "
            "(checked every 60 s) and redelivers it: lower the limit or raise consumer_timeout",
        )


def serve_metrics(config: WorkerConfig, pool: ProcessPool) -> WorkerMetrics | None:
    """With ``--metrics-port``, the worker's metrics, counted from its children's reports and served.

    Args:
        config: worker options.
        pool: the process pool whose children report their counts.

    Returns:
        The metrics, already serving; None without ``--metrics-port``.
    """
    if config.metrics_port is None:
        return None
    # Imported here: prometheus_client (and the HTTP server it brings) costs a worker without
    # --metrics-port about 3 MiB it never uses.
    from worker.metrics import WorkerMetrics

    # Read at each scrape, so the figures are now's.
    metrics = WorkerMetrics(config.hostname, pool_size=lambda: pool.target, busy=lambda: pool.busy_count)
    pool.feeding.on_tally = metrics.add  # the children count their own tasks
    metrics.serve(config.metrics_port, config.metrics_address)
    log.info("metrics_serving", port=config.metrics_port, address=config.metrics_address)
    return metrics
