"""What the figures were measured on: CPU, RAM, kernel, Python, RabbitMQ, package versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from broker_svc.version import DISTRIBUTION, UNKNOWN_VERSION, version

# The libraries beside ours, whose version is broker_svc.version's (the checkout's, measured from one).
OUR_DISTRIBUTIONS = ("pika", "aio-pika", "aiormq", "pamqp", "structlog", "msgpack")


def _first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def rabbitmq_version() -> str:
    """The local node's version (``rabbitmqctl version``), or ``unknown``."""
    try:
        done = subprocess.run(["rabbitmqctl", "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return lines[-1].strip() if done.returncode == 0 and lines else "unknown"


def describe() -> dict[str, str]:
    """CPU count and model, RAM, kernel, Python, RabbitMQ."""
    mem_kib = _first("/proc/meminfo", "MemTotal")
    ram = f"{int(mem_kib.split()[0]) / 1024 / 1024:.1f} GiB" if mem_kib else "unknown"
    return {
        "cpus": str(os.cpu_count()),
        "cpu_model": _first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "ram": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "rabbitmq": rabbitmq_version(),
    }


def our_versions() -> dict[str, str]:
    """Versions of our package and the AMQP libraries in the project venv."""
    found = {DISTRIBUTION: version()} if version() != UNKNOWN_VERSION else {}
    for name in OUR_DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found
