"""Our ``ctl`` against a real Celery worker: inspect, status and revoke read Celery's replies."""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Callable

from tests.interop.conftest import celery_node_name
from tests.support.cli import run_ctl
from tests.support.pidbox import call
from tests.support.workers import unique_queue


def test_ctl_inspects_and_revokes_on_a_celery_worker(
    test_vhost_url: str, start_celery_worker: Callable[..., subprocess.Popen[bytes]]
):
    queue = unique_queue("ctlc")
    start_celery_worker(queue, social=True)
    node = celery_node_name(queue)
    base = ("-b", test_vhost_url, "-d", node, "--timeout", "5", "--json")

    proc, elapsed = run_ctl("inspect", "ping", *base)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {node: {"ok": "pong"}}
    assert elapsed < 4  # a named destination ends the wait when it answered

    proc, _ = run_ctl("inspect", "registered", *base)
    assert proc.returncode == 0, proc.stderr
    assert "interop.mul" in json.loads(proc.stdout)[node]

    proc, _ = run_ctl("inspect", "stats", *base)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)[node]["pid"] > 0

    task_id = str(uuid.uuid4())
    proc, _ = run_ctl("revoke", task_id, *base)
    assert proc.returncode == 0, proc.stderr
    assert task_id in proc.stdout
    revoked = call(test_vhost_url, "revoked", destination=[node], expect=1)[0][1][node]
    assert task_id in revoked

    proc, _ = run_ctl("status", "-b", test_vhost_url, "-d", node, "--timeout", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"{node}: OK" in proc.stdout
