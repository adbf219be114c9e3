"""The periodic scheduler with many entries: its CPU, its fires per second, how late they go out.

One ``clockwork-beat`` leader (a subprocess, so its CPU is its own; ``bench/beat_app.py`` gives it
``--entries`` entries, ``burst``: all every 10 s, or ``spread``: every 1..60 s) on the broker, in
a vhost of its own that is deleted afterwards. Nobody consumes the task queue: a policy keeps its
newest 10,000 messages. After the first fire and a warm-up, over ``--seconds``:

- CPU: the scheduler process's user + system seconds (all its threads, ``/proc/<pid>/stat``) per
  wall second, and the local broker's (its journal stream and the task queue take every fire);
- fires per second: its ``beat_fired`` log lines in the window, beside what the schedule asks;
- lateness: ``late_s`` (scheduled instant to the fire confirmed: a batch of fires due together
  shares the batch's) of the fires scheduled in the window (the scheduler is given up to 60 s
  more to fire them; any it has not fired by then count as ``unfired``: with ``catch_up="once"``
  an entry's instants that fell due while the scheduler was busy are fired once, as the latest).

Usage: ``python -m bench.beat [--entries 10000] [--seconds 60] [--shapes burst,spread]
[--catch-up once|all] [--profile DIR] [--broker URL]``. ``--profile`` runs the scheduler under
cProfile (the hooks' thread: the leader's loop) and writes ``DIR/beat-<shape>.prof``; its figures
are then cProfile's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.beat_app import schedule
from bench.control import vhost
from bench.spine import parse_args
from bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench-beat-tasks"
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14 and 15)


def _broker_pid() -> int | None:
    """The local RabbitMQ node's OS pid (``rabbitmqctl eval``), None if it cannot be asked."""
    try:
        done = subprocess.run(
            ["rabbitmqctl", "eval", "os:getpid()."], capture_output=True, text=True, timeout=60
        )
        pid = int(done.stdout.strip().strip('"'))
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _events(log: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == name:
            out.append(event)
    return out


def _stamp(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["timestamp"]).timestamp()


def _expected(intervals: Counter[float], start: float, end: float) -> int:
    """The fires the schedule asks for at instants in ``[start, end)`` (intervals anchored at 0)."""
    return sum(n * (math.ceil(end / k) - math.ceil(start / k)) for k, n in intervals.items())


def _wait_event(log: Path, name: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _events(log, name):
        if proc.poll() is not None:
            raise RuntimeError(f"clockwork-beat exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {name} within {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def measure(
    url: str,
    *,
    shape: str,
    entries: int,
    seconds: float,
    warmup_s: float,
    catch_up: str = "once",
    profile: Path | None = None,
    broker_pid: int | None = None,
) -> dict[str, Any]:
    """Run one scheduler with ``entries`` entries of ``shape`` and measure it (module docstring)."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    log = Path(tempfile.mkstemp(prefix="bench-beat-", suffix=".log")[1])
    runner = [sys.executable]
    if profile is not None:
        runner += ["-m", "cProfile", "-o", str(profile / f"beat-{shape}.prof")]
    command = [
        *runner, "-m", "worker.beat", "-A", "bench.beat_app:app", "-b", url, "-l", "info",
        "--scheduler-name", name, "--beat-lease", "10",
    ]  # fmt: skip
    env = {
        **os.environ, "CLOCKWORK_BROKER_URL": url, "BENCH_BEAT_ENTRIES": str(entries),
        "BENCH_BEAT_SHAPE": shape, "BENCH_BEAT_QUEUE": QUEUE, "BENCH_BEAT_CATCH_UP": catch_up,
        "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    entries_json = schedule(entries, shape, QUEUE, catch_up).values()
    intervals = Counter(float(entry["schedule"]) for entry in entries_json)
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        started = time.monotonic()
        _wait_event(log, "beat_leading", proc, timeout_s=120)
        leading_s = time.monotonic() - started  # start-up: imports, the entries parsed, elected
        _wait_event(log, "beat_fired", proc, timeout_s=120)
        time.sleep(warmup_s)
        t0, cpu0 = time.time(), _cpu_s(proc.pid)
        broker0 = _cpu_s(broker_pid) if broker_pid else 0.0
        time.sleep(seconds)
        t1, cpu1 = time.time(), _cpu_s(proc.pid)
        broker1 = _cpu_s(broker_pid) if broker_pid else 0.0
        load_1m = os.getloadavg()[0]
        rss_mb = _rss_mb(proc.pid)
        # Let it fire what fell due in the window (it may be behind), up to a minute more.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            fired = _events(log, "beat_fired")
            if any(event["scheduled"] >= t1 for event in fired):
                break
            time.sleep(1.0)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # hands over: saves the state (cProfile writes its file)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    fired = _events(log, "beat_fired")
    log.unlink()
    in_window = [e for e in fired if t0 <= e["scheduled"] < t1]
    late = [float(e["late_s"]) for e in in_window]
    tail = [float(e["late_s"]) for e in in_window if e["scheduled"] >= t1 - 10]
    window = t1 - t0
    expected = _expected(intervals, t0, t1)
    return {
        "shape": shape,
        "catch_up": catch_up,
        "entries": entries,
        "window_s": round(window, 1),
        "leading_s": round(leading_s, 1),
        "cpu_s_per_s": round((cpu1 - cpu0) / window, 3),
        "broker_cpu_s_per_s": round((broker1 - broker0) / window, 3) if broker_pid else None,
        "fires_per_s": round(sum(1 for e in fired if t0 <= _stamp(e) < t1) / window, 1),
        "asked_per_s": round(expected / window, 1),
        "unfired": expected - len(in_window),
        "late_p50_s": round(percentile(late, 0.50), 3) if len(late) > 1 else None,
        "late_p99_s": round(percentile(late, 0.99), 3) if len(late) > 1 else None,
        "late_max_s": round(max(late), 3) if late else None,
        "late_max_last_10s_s": round(max(tail), 3) if tail else None,
        "rss_mb": round(rss_mb, 1),
        "load_1m": round(load_1m, 2),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    columns = [
        "shape", "catch_up", "entries", "cpu_s_per_s", "broker_cpu_s_per_s", "fires_per_s", "asked_per_s",
        "unfired", "late_p50_s", "late_p99_s", "late_max_s", "late_max_last_10s_s", "rss_mb", "leading_s",
        "load_1m",
    ]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=5.0, help="unmeasured seconds after the first fire")
    parser.add_argument("--shapes", default="burst,spread", help="burst, spread or both")
    parser.add_argument("--catch-up", default="once", choices=["once", "all"], help="the entries' catch_up")
    parser.add_argument("--profile", type=Path, default=None, help="run under cProfile, .prof files here")


def main() -> int:
    args = parse_args(_options)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    rows = []
    broker_pid = _broker_pid() if urlsplit(args.broker).hostname in ("127.0.0.1", "localhost") else None
    with vhost(args.broker) as url:
        # Nobody consumes: keep the task queue's newest 10,000 (the journal stream bounds itself).
        policy = json.dumps({"max-length": 10_000, "overflow": "drop-head"})
        subprocess.run(
            ["rabbitmqctl", "set_policy", "-p", url.rsplit("/", 1)[1], "bench-beat-bound", f"^{QUEUE}$",
             policy, "--apply-to", "queues"],
            check=True, capture_output=True,
        )  # fmt: skip
        for shape in args.shapes.split(","):
            row = measure(url, shape=shape, entries=args.entries, seconds=args.seconds,
                          warmup_s=args.warmup, catch_up=args.catch_up, profile=args.profile,
                          broker_pid=broker_pid)  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
