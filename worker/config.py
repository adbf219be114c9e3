"""The worker's own options (what ``python -m worker`` takes), beside the shared ``Settings``."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings

__all__ = [
    "DEFAULT_CONSUMER_TIMEOUT_S",
    "DEFAULT_HOSTNAME",
    "WorkerConfig",
    "default_state_path",
    "expand_hostname",
    "parse_autoscale",
    "prefetch_for",
    "time_limits_over_consumer_timeout",
]

# Celery's default node name, so scripts that address ``celery@host`` keep working.
DEFAULT_HOSTNAME = "celery@%h"

# RabbitMQ's own default ``consumer_timeout`` (30 min): a delivery held unacked longer gets its
# channel closed with a 406. The worker cannot read the broker's value, so it is told it.
DEFAULT_CONSUMER_TIMEOUT_S = 1800.0

# The broker enforces consumer_timeout on a 60 s tick: a limit within this of it is not safe.
CONSUMER_TIMEOUT_TICK_S = 60.0


def expand_hostname(template: str, host: str | None = None) -> str:
    """Expand Celery's ``%h`` (host), ``%n`` (host name part), ``%d`` (domain) and ``%%``."""
    full = host or socket.gethostname()
    name, _, domain = full.partition(".")
    out = template.replace("%%", "\0").replace("%h", full).replace("%n", name).replace("%d", domain)
    return out.replace("\0", "%")


def default_state_path(hostname: str) -> Path:
    """Where a node keeps its revoked set: ``$CLOCKWORK_STATE_DIR``, else the XDG state directory."""
    base = os.environ.get("CLOCKWORK_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "clockwork"
    )
    safe = "".join(c if c.isalnum() or c in "@._-" else "_" for c in hostname)
    return Path(base) / f"{safe}.state"


def parse_autoscale(value: str) -> tuple[int, int]:
    """Read Celery's ``--autoscale MAX,MIN`` (or ``MAX``): ``(max, min)``; MIN defaults to 0.

    As Celery, the larger number is the maximum whichever comes first.

    Raises:
        ValueError: not one or two comma-separated integers, a negative one, or a maximum of 0.
    """
    parts = [p.strip() for p in value.split(",")]
    if not 1 <= len(parts) <= 2:
        raise ValueError(f"expected MAX or MAX,MIN (for example 10,3), got {value!r}")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"expected integers, as in --autoscale 10,3; got {value!r}") from None
    maximum, minimum = max(numbers), (min(numbers) if len(numbers) == 2 else 0)
    if minimum < 0 or maximum < 1:
        raise ValueError(f"autoscale needs MAX >= 1 and MIN >= 0, got {value!r}")
    return maximum, minimum


def prefetch_for(children: int, *, multiplier: int, threads: int = 1) -> int:
    """What ``children`` consuming children hold unacked together at most (inspect ``stats``).

    Each child's connection has a per-consumer prefetch of ``multiplier`` for each of its
    ``threads``; a pool that grows or shrinks brings or takes its children's share.
    """
    return children * threads * multiplier


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How one worker runs.

    Attributes:
        app_spec: ``package.module:app``, imported by the worker and each child.
        settings: broker URL and codec settings.
        hostname: node name ``name@host`` (templates expanded).
        queues: the task queues to consume.
        concurrency: child processes.
        prefetch_multiplier: unacked deliveries per child (per thread under ``threads``), the
            per-consumer QoS of its connection. Tasks are acked after they ran, so running ones
            count: with 1, a child holds no task it cannot start now, and a busy worker hoards nothing.
            With ``prefetch_budget_s``, where each child starts.
        prefetch_budget_s: each child's prefetch follows its task times, so it holds about this
            many seconds of work (``worker/rules/prefetch_budget.py``); None: fixed at
            ``prefetch_multiplier``.
        shutdown_timeout_s: how long running tasks may finish after SIGTERM.
        dedupe_window_s: skip a task id this worker finished within this many seconds (opt-in
            dedupe, per worker: one window shared by the children, ``worker.shared.dedupe``). None:
            at-least-once, every delivery runs. The delivery limit is ``settings.delivery_limit``.
        time_limit_s: hard time limit for tasks that set none (the task's and the call's win).
        soft_time_limit_s: soft time limit for tasks that set none.
        state_path: the state file of the revoked set (None: kept in memory only).
        task_events: send task-* events from the start (``-E``).
        event_heartbeat_s: seconds between ``worker-heartbeat`` events (``--heartbeat-interval``);
            not the AMQP heartbeat, which is ``broker_heartbeat_s``.
        mingle: sync revoked ids and clocks with peers at start-up and after reconnects.
        namespace: the control namespace (Celery's ``control_exchange``).
        autoscale: ``(max, min)`` children with ``--autoscale``; ``concurrency`` is then the size
            the pool starts at (``min``, at least 1). None: the pool keeps ``concurrency`` children.
        autoscale_keepalive_s: how long a child the pool did not need stays before the autoscaler
            retires it.
        broker_heartbeat_s: the AMQP heartbeat the worker asks for (None: ``settings.heartbeat_s``;
            0 turns heartbeats off). A worker frozen for over twice this loses its connection,
            and the broker requeues what it held.
        consumer_timeout_s: the broker's ``consumer_timeout`` (RabbitMQ's default is 30 min), for
            the start-up check of task time limits against it. None: no check.
        max_tasks_per_child: a child is replaced after this many tasks (None: never).
        max_memory_per_child_kib: a child whose resident memory passed this many KiB is replaced
            after the task it ran (None: never).
        metrics_port: serve Prometheus metrics on this port (None: not served; worker/metrics.py).
        metrics_address: the address the metrics are served on.
        threads: consumers per child, each a thread, sharing the child's connection, for tasks
            that wait on I/O (1: the child's main thread alone).

    Raises:
        ConfigurationError: an option out of range (a ``ValueError``, with the fix in its text).
    """

    app_spec: str
    settings: Settings
    hostname: str = field(default_factory=lambda: expand_hostname(DEFAULT_HOSTNAME))
    queues: tuple[str, ...] = ("celery",)
    concurrency: int = field(default_factory=lambda: os.cpu_count() or 1)
    prefetch_multiplier: int = 1
    prefetch_budget_s: float | None = None
    shutdown_timeout_s: float = 30.0
    dedupe_window_s: float | None = None
    time_limit_s: float | None = None
    soft_time_limit_s: float | None = None
    state_path: Path | None = None
    task_events: bool = False
    event_heartbeat_s: float = 2.0
    mingle: bool = True
    namespace: str = "celery"
    autoscale: tuple[int, int] | None = None
    autoscale_keepalive_s: float = 30.0
    broker_heartbeat_s: int | None = None
    consumer_timeout_s: float | None = DEFAULT_CONSUMER_TIMEOUT_S
    max_tasks_per_child: int | None = None
    max_memory_per_child_kib: int | None = None
    metrics_port: int | None = None
    metrics_address: str = "0.0.0.0"
    threads: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.prefetch_multiplier < 1:
            raise ConfigurationError(
                f"prefetch_multiplier must be at least 1, got {self.prefetch_multiplier}"
            )
        if self.prefetch_budget_s is not None and not self.prefetch_budget_s > 0:
            raise ConfigurationError(f"prefetch_budget_s must be positive, got {self.prefetch_budget_s}")
        if not self.queues or not all(self.queues):
            raise ConfigurationError("give at least one non-empty queue name (-Q a,b)")
        if self.dedupe_window_s is not None and not self.dedupe_window_s > 0:
            raise ConfigurationError(f"dedupe_window_s must be positive, got {self.dedupe_window_s}")
        if not self.event_heartbeat_s > 0:
            raise ConfigurationError(f"event_heartbeat_s must be positive, got {self.event_heartbeat_s}")
        if self.broker_heartbeat_s is not None and self.broker_heartbeat_s < 0:
            raise ConfigurationError(
                f"broker_heartbeat_s must be 0 (off) or positive, got {self.broker_heartbeat_s}"
            )
        if self.consumer_timeout_s is not None and not self.consumer_timeout_s > 0:
            raise ConfigurationError(f"consumer_timeout_s must be positive, got {self.consumer_timeout_s}")
        if self.threads < 1:
            raise ConfigurationError(f"threads must be at least 1, got {self.threads}")
        if "@" not in self.hostname:
            raise ConfigurationError(f"hostname must look like name@host, got {self.hostname!r}")
        if self.autoscale is not None:
            maximum, minimum = self.autoscale
            if not 0 <= minimum <= maximum or maximum < 1:
                raise ConfigurationError(
                    f"autoscale must be (max, min) with max >= 1 and 0 <= min <= max, got {self.autoscale}"
                )
            if not max(minimum, 1) <= self.concurrency <= maximum:
                raise ConfigurationError(
                    f"with autoscale {self.autoscale}, concurrency (the starting size) must be between "
                    f"{max(minimum, 1)} and {maximum}, got {self.concurrency}"
                )
            if not self.autoscale_keepalive_s > 0:
                raise ConfigurationError(
                    f"autoscale_keepalive_s must be positive, got {self.autoscale_keepalive_s}"
                )

    @property
    def prefetch_count(self) -> int:
        """What the children hold unacked together at most, at start; resizing the pool changes it."""
        return prefetch_for(self.concurrency, multiplier=self.prefetch_multiplier, threads=self.threads)


def time_limits_over_consumer_timeout(
    limits: Mapping[str, float | None], *, consumer_timeout_s: float | None
) -> dict[str, float]:
    """The task time limits the broker's ``consumer_timeout`` would cut short: ``{task: limit}``.

    A delivery stays unacked while its task runs, so a task allowed to run past the timeout gets
    its channel closed by the broker (406) and is redelivered. The broker checks on a 60 s tick,
    so a limit within 60 s of the timeout is reported too. Tasks without a limit are not listed:
    they are unbounded either way.

    Args:
        limits: each task's effective hard time limit in seconds (None: none).
        consumer_timeout_s: the broker's consumer timeout; None disables the check.

    Returns:
        The offending tasks and their limits.
    """
    if consumer_timeout_s is None:
        return {}
    bound = consumer_timeout_s - CONSUMER_TIMEOUT_TICK_S
    return {name: limit for name, limit in sorted(limits.items()) if limit is not None and limit >= bound}
