"""The worker's own options (what ``python -m worker`` takes), beside the shared ``Settings``."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from broker_svc.settings import Settings

__all__ = ["DEFAULT_HOSTNAME", "WorkerConfig", "default_state_path", "expand_hostname"]

# Celery's default node name, so scripts that address ``celery@host`` keep working.
DEFAULT_HOSTNAME = "celery@%h"


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


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """How one worker runs.

    Attributes:
        app_spec: ``package.module:app``, imported by the worker and each child.
        settings: broker URL and codec settings.
        hostname: node name ``name@host`` (templates expanded).
        queues: the task queues to consume.
        concurrency: child processes.
        prefetch_multiplier: unacked deliveries per child, per queue (per-consumer QoS = this ×
            children). Tasks are acked after they ran, so running ones count: with 1, a worker holds
            no task it cannot start now, and a busy worker hoards nothing.
        shutdown_timeout_s: how long running tasks may finish after SIGTERM.
        max_child_deaths: how often a message may kill a child before it is dead-lettered.
        time_limit_s: hard time limit for tasks that set none (the task's and the call's win).
        soft_time_limit_s: soft time limit for tasks that set none.
        state_path: the state file of the revoked set (None: kept in memory only).
        task_events: send task-* events from the start (``-E``).
        heartbeat_s: the worker-heartbeat interval.
        mingle: sync revoked ids and clocks with peers at start-up and after reconnects.
        namespace: the control namespace (Celery's ``control_exchange``).
    """

    app_spec: str
    settings: Settings
    hostname: str = field(default_factory=lambda: expand_hostname(DEFAULT_HOSTNAME))
    queues: tuple[str, ...] = ("celery",)
    concurrency: int = field(default_factory=lambda: os.cpu_count() or 1)
    prefetch_multiplier: int = 1
    shutdown_timeout_s: float = 30.0
    max_child_deaths: int = 3
    time_limit_s: float | None = None
    soft_time_limit_s: float | None = None
    state_path: Path | None = None
    task_events: bool = False
    heartbeat_s: float = 2.0
    mingle: bool = True
    namespace: str = "celery"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        if self.prefetch_multiplier < 1:
            raise ValueError(f"prefetch_multiplier must be at least 1, got {self.prefetch_multiplier}")
        if not self.queues or not all(self.queues):
            raise ValueError("give at least one non-empty queue name (-Q a,b)")
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if "@" not in self.hostname:
            raise ValueError(f"hostname must look like name@host, got {self.hostname!r}")

    @property
    def prefetch_count(self) -> int:
        """basic.qos prefetch per consumer (global=False)."""
        return self.concurrency * self.prefetch_multiplier
