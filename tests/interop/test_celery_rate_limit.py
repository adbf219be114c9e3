"""The real `celery control rate_limit` changes a rate on our worker."""

from __future__ import annotations

import subprocess
import sys

from tests.support.workers import ROOT, WorkerProcess, unique_queue

LIMITED = "tests.integration.e2e_tasks.limited"


def test_celery_control_rate_limit_reaches_our_worker(test_vhost_url: str):
    with WorkerProcess(test_vhost_url, queues=[unique_queue("rl")], concurrency=1) as worker:
        worker.wait_ready()
        proc = subprocess.run(
            [sys.executable, "-m", "celery", "-b", test_vhost_url, "control", "rate_limit", LIMITED, "5/m",
             "-d", worker.name, "--timeout", "5"],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{worker.name}: OK" in proc.stdout and "new rate limit set successfully" in proc.stdout
