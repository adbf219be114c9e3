"""Control-plane figures, ours beside Celery's in one run.

- ``inspect ping`` latency with 1 and 3 workers: in-process (our ``ControlClient`` vs Celery's
  ``app.control.inspect().ping()``) and as a command (``ctl inspect ping`` vs ``celery inspect
  ping``, Python start-up included);
- revoke-to-skip: from ``revoke()`` to the REVOKED result of a task sent right after it;
- Mingle time of a worker joining 3 peers (ours from its log, Celery's from its log).

Usage: ``python -m bench.control [--broker URL]`` (a vhost of its own is created and removed).
Prints one JSON line per figure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from bench.spine import NOOP, parse_args, worker
from broker_svc import App, Settings, TaskRevokedError
from control.blocking.client import ControlClient

ROOT = Path(__file__).resolve().parent.parent


def _ms(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(samples), 1),
        "max_ms": round(max(samples), 1),
        "n": len(samples),
    }


def _timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


@contextlib.contextmanager
def vhost(base_url: str) -> Iterator[str]:
    name = f"bench-control-{uuid.uuid4().hex[:8]}"
    subprocess.run(["rabbitmqctl", "add_vhost", name], check=True, capture_output=True)
    subprocess.run(["rabbitmqctl", "set_permissions", "-p", name, "guest", ".*", ".*", ".*"], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield urlunsplit(urlsplit(base_url)._replace(path="/" + name))
    finally:
        subprocess.run(["rabbitmqctl", "delete_vhost", name], capture_output=True)


@contextlib.contextmanager
def celery_workers(url: str, count: int, queue: str) -> Iterator[list[str]]:
    procs, logs, names = [], [], []
    for i in range(count):
        log = Path(tempfile.mkstemp(prefix="bench-celery-", suffix=".log")[1])
        names.append(f"celery{i}-{queue}@bench")
        with log.open("w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.celery_tasks", "worker", "-P", "solo",
                 "-Q", queue, "-n", names[-1], "-l", "info"],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "BENCH_BROKER_URL": url},
            ))  # fmt: skip
        logs.append(log)
    try:
        deadline = time.monotonic() + 90
        while not all("ready." in log.read_text() for log in logs):
            if time.monotonic() > deadline:
                raise TimeoutError("celery workers did not start")
            time.sleep(0.2)
        yield names
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        celery_workers.last_logs = [log.read_text() for log in logs]  # type: ignore[attr-defined]
        for log in logs:
            log.unlink(missing_ok=True)


def _cli(cmd: list[str], runs: int) -> list[float]:
    return _timed(lambda: subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False), runs)


def ping_figures(url: str, workers: int, runs: int) -> dict[str, object]:
    queue = f"bench-ping-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        for i in range(workers):
            stack.enter_context(worker(url, queue, 1, name=f"w{i}-{queue}@bench"))
        with ControlClient(Settings(broker_url=url)) as client:
            client.inspect("ping", timeout_s=5.0)  # connect and learn the members first
            answered = len(client.inspect("ping", timeout_s=5.0))
            ours = _timed(lambda: client.inspect("ping", timeout_s=5.0), runs)
        ctl = _cli([sys.executable, "-m", "control.cli", "-b", url, "--timeout", "5", "inspect", "ping"], 5)
    from celery import Celery

    with celery_workers(url, workers, queue):
        app = Celery("bench-client", broker=url)
        inspector = app.control.inspect(timeout=1.0)
        inspector.ping()
        celery_answered = len(inspector.ping() or {})
        theirs = _timed(inspector.ping, runs)
        celery_cli = _cli([sys.executable, "-m", "celery", "-b", url, "inspect", "ping", "--timeout", "1"], 5)
        app.close()
    return {
        "workers": workers,
        "ours_answered": answered,
        "celery_answered": celery_answered,
        "ours_in_process": _ms(ours),
        "celery_in_process_timeout_1s": _ms(theirs),
        "ctl_command": _ms(ctl),
        "celery_command_timeout_1s": _ms(celery_cli),
    }


def revoke_to_skip(url: str, runs: int) -> dict[str, object]:
    queue = f"bench-revoke-{uuid.uuid4().hex[:6]}"
    samples, calls = [], []
    with (
        worker(url, queue, 1, name=f"r-{queue}@bench"),
        App("bench-revoke", settings=Settings(broker_url=url)) as app,
    ):
        with ControlClient(Settings(broker_url=url), clock=app.clock) as client:
            client.inspect("ping", timeout_s=5.0)
            for _ in range(runs):
                task_id = str(uuid.uuid4())
                started = time.perf_counter()
                # reply=True: the call returns once every live worker holds the id (each has told
                # its consuming children), so the task sent next is skipped. Without a reply the
                # revoke can reach a worker after the task reaches one of its children.
                client.revoke(task_id, reply=True, timeout_s=5.0)
                calls.append((time.perf_counter() - started) * 1000)
                result = app.send_task(NOOP, queue=queue, task_id=task_id)
                try:
                    result.get(timeout=30)
                    raise AssertionError("a revoked task ran")
                except TaskRevokedError:
                    samples.append((time.perf_counter() - started) * 1000)
    return {"revoke_call": _ms(calls), "revoke_to_revoked_result": _ms(samples)}


def mingle_figures(url: str) -> dict[str, object]:
    queue = f"bench-mingle-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        for i in range(3):
            stack.enter_context(worker(url, queue, 1, name=f"p{i}-{queue}@bench"))
        lines: list[bytes] = []
        with worker(url, queue, 1, name=f"new-{queue}@bench", lines=lines):
            record = next(json.loads(line) for line in lines if b"mingle_done" in line)
    with celery_workers(url, 4, queue):
        pass
    stamps = []
    for text in celery_workers.last_logs:  # type: ignore[attr-defined]
        found = re.findall(
            r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+).*mingle: (searching|sync complete|all alone)", text
        )
        if len(found) >= 2:
            times = [datetime.strptime(t, "%Y-%m-%d %H:%M:%S,%f") for t, _ in found[:2]]
            stamps.append((times[1] - times[0]).total_seconds() * 1000)
    return {
        "ours_ms_with_3_peers": record["ms"],
        "ours_synced": record["synced"],
        "celery_ms_per_worker_started_together": _ms(stamps) if stamps else None,
    }


def main() -> int:
    args = parse_args(lambda parser: parser.add_argument("--runs", type=int, default=20))
    with vhost(args.broker) as url:
        for workers in (1, 3):
            print(json.dumps({"figure": "inspect_ping", **ping_figures(url, workers, args.runs)}), flush=True)
        print(json.dumps({"figure": "revoke_to_skip", **revoke_to_skip(url, args.runs)}), flush=True)
        print(json.dumps({"figure": "mingle", **mingle_figures(url)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
