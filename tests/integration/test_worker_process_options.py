"""Celery's worker options for the process itself: --pidfile, --logfile, -P, -O (-B: test_beat.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

APP = "tests.integration.e2e_tasks:app"


def test_pidfile_and_logfile_hold_the_worker_and_its_childrens_output(test_vhost_url: str, tmp_path: Path):
    queue = unique_queue("files")
    pidfile, logfile = tmp_path / "run" / "worker.pid", tmp_path / "worker.log"
    args = ["--pidfile", str(pidfile), "--logfile", str(logfile)]
    worker = WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=args)
    try:
        wait_for(lambda: pidfile.exists(), timeout_s=30, message="no pidfile")
        assert int(pidfile.read_text()) == worker.pid
        wait_for(lambda: logfile.exists() and "worker_ready" in logfile.read_text(), timeout_s=60,
                 message="the worker did not log to its logfile")  # fmt: skip
        assert worker.log_text() == ""  # nothing left on the terminal
        # A second worker on the same pidfile refuses to start while the first runs.
        second = _run_worker(test_vhost_url, queue, "--pidfile", str(pidfile))
        assert second.returncode == 2
        assert f"names process {worker.pid}" in second.stderr
        assert worker.terminate() == 0
        assert not pidfile.exists()  # removed at exit
        records = [json.loads(line) for line in logfile.read_text().splitlines() if line.startswith("{")]
        assert any(r["event"] == "worker_ready" for r in records)
    finally:
        worker.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["-P", "solo"], "-P solo: Clockwork runs tasks in a process pool (prefork); for one task at a time"),
        (
            ["-P", "gevent"],
            "-P gevent: Clockwork runs tasks in a process pool (prefork); for tasks that wait",
        ),
        (
            ["-P", "threads"],
            "-P threads: Clockwork runs tasks in a process pool (prefork); for tasks that wait "
            "on I/O use --threads N",
        ),
        (["--pool", "threads"], "'-P threads -c 8' is about '-c 1 --threads 8'"),
        (["--pool=threads"], "use --threads N"),
    ],
)
def test_pools_not_built_yet_are_refused_with_a_reason(test_vhost_url: str, option, said):
    result = _run_worker(test_vhost_url, "unused", *option)
    assert result.returncode == 2
    assert said in result.stderr
    assert len(result.stderr.splitlines()) == 2, result.stderr  # the error, and where the options are


def test_fair_optimization_and_the_prefork_pool_are_accepted():
    from worker.__main__ import parse_args

    args = parse_args(["-A", APP, "-O", "fair", "-P", "prefork", "--max-tasks-per-child", "5"])
    assert (args.optimization, args.pool, args.max_tasks_per_child) == ("fair", "prefork", 5)
    with pytest.raises(SystemExit):
        parse_args(["-A", APP, "--max-tasks-per-child", "0"])


def _run_worker(url: str, queue: str, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "worker", "-A", APP, "-b", url, "-Q", queue, "-c", "1", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)


def test_the_worker_takes_its_queue_from_app_conf_over_the_environment(test_vhost_url: str):
    conf_queue, env_queue = unique_queue("from-conf"), unique_queue("from-env")
    env = {
        "PROJ_BROKER_URL": test_vhost_url,
        "PROJ_QUEUE": conf_queue,  # the proj app sets task_default_queue from this
        "CLOCKWORK_DEFAULT_QUEUE": env_queue,
    }
    worker = WorkerProcess(test_vhost_url, app="tests.integration.proj.celery:app", queues=[], env=env)
    try:
        worker.wait_ready()
        assert worker.first("worker_ready")["queues"][0] == conf_queue
    finally:
        worker.close()
        delete_queues(test_vhost_url, conf_queue, env_queue, f"{conf_queue}.dead")
