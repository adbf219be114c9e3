"""The real `celery control pool_grow|pool_shrink|autoscale` resize our worker's pool, and
`celery inspect stats` reads the result (``pool.max-concurrency``, ``autoscaler``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop


def celery(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-b", url, "--no-color", *args, "--timeout", "5"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def control(url: str, node: WorkerProcess, *args: str) -> str:
    """``celery control <args> -d <node>``: exit 0 and the node's OK line; the printed output."""
    proc = celery(url, "control", *args, "-d", node.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"->  {node.name}: OK" in proc.stdout, proc.stdout + proc.stderr  # ERROR: an {"error": ...}
    return proc.stdout


def celery_stats(url: str, node: WorkerProcess) -> dict[str, Any]:
    proc = celery(url, "inspect", "stats", "-d", node.name, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    value = json.loads(proc.stdout.splitlines()[0])[node.name]
    assert isinstance(value, dict)
    return value


@pytest.fixture
def fixed(test_vhost_url: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(test_vhost_url, queues=[unique_queue("pool")], concurrency=1) as worker:
        yield worker.wait_ready()


@pytest.fixture
def scaled(test_vhost_url: str) -> Iterator[WorkerProcess]:
    args = ["--autoscale", "4,1"]
    with WorkerProcess(
        test_vhost_url, queues=[unique_queue("auto")], concurrency=1, extra_args=args
    ) as worker:
        yield worker.wait_ready()


def test_celery_control_pool_grow_and_pool_shrink_resize_our_pool(test_vhost_url: str, fixed: WorkerProcess):
    assert "pool will grow" in control(test_vhost_url, fixed, "pool_grow", "2")

    def three_children() -> bool:
        pool = celery_stats(test_vhost_url, fixed)["pool"]
        return pool["max-concurrency"] == 3 and len(pool["processes"]) == 3

    wait_for(three_children, timeout_s=15, interval_s=0.2, message="celery inspect stats shows 3 children")
    assert "pool will shrink" in control(test_vhost_url, fixed, "pool_shrink", "1")
    assert celery_stats(test_vhost_url, fixed)["pool"]["max-concurrency"] == 2


def test_celery_control_autoscale_moves_our_range(test_vhost_url: str, scaled: WorkerProcess):
    assert "autoscale now max=3 min=2" in control(test_vhost_url, scaled, "autoscale", "3", "2")
    stats = celery_stats(test_vhost_url, scaled)
    assert stats["autoscaler"] == {"max": 3, "min": 2, "current": 2, "qty": 0}
    assert stats["pool"]["max-concurrency"] == 2
    # Under autoscale, pool_grow gets Celery's own refusal, which its CLI prints as an error.
    refused = celery(test_vhost_url, "control", "pool_grow", "1", "-d", scaled.name)
    assert f"->  {scaled.name}: ERROR" in refused.stdout, refused.stdout + refused.stderr
    assert "pool_grow is not supported with autoscale" in refused.stdout


def test_celery_control_adds_and_cancels_a_consumer(test_vhost_url: str, fixed: WorkerProcess):
    extra = unique_queue("cc")
    out = control(test_vhost_url, fixed, "add_consumer", extra)
    assert f"add consumer {extra}" in out
    proc = celery(test_vhost_url, "inspect", "active_queues", "-d", fixed.name, "--json")
    assert extra in [q["name"] for q in json.loads(proc.stdout.splitlines()[0])[fixed.name]]
    out = control(test_vhost_url, fixed, "cancel_consumer", extra)
    assert f"no longer consuming from {extra}" in out
