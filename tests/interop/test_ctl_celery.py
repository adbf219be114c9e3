"""Our ``ctl`` against a real Celery worker: inspect, status and revoke read Celery's replies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from tests.interop.conftest import celery_node_name
from tests.pidbox import call
from tests.workers import ROOT, unique_queue


def _ctl(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "control.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    return proc, time.monotonic() - started


def test_ctl_inspects_and_revokes_on_a_celery_worker(
    test_vhost_url: str, start_celery_worker: Callable[..., subprocess.Popen[bytes]]
):
    queue = unique_queue("ctlc")
    start_celery_worker(queue, social=True)
    node = celery_node_name(queue)
    base = ("-b", test_vhost_url, "-d", node, "--timeout", "5", "--json")

    proc, elapsed = _ctl("inspect", "ping", *base)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {node: {"ok": "pong"}}
    assert elapsed < 4  # a named destination ends the wait when it answered

    proc, _ = _ctl("inspect", "registered", *base)
    assert proc.returncode == 0, proc.stderr
    assert "interop.mul" in json.loads(proc.stdout)[node]

    proc, _ = _ctl("inspect", "stats", *base)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[node]["pid"] > 0

    task_id = str(uuid.uuid4())
    proc, _ = _ctl("revoke", task_id, *base)
    assert proc.returncode == 0, proc.stderr
    assert task_id in proc.stdout
    revoked = call(test_vhost_url, "revoked", destination=[node], expect=1)[0][1][node]
    assert task_id in revoked

    proc, _ = _ctl("status", "-b", test_vhost_url, "-d", node, "--timeout", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"{node}: OK" in proc.stdout
