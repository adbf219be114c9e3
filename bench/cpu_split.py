"""Where a drain's CPU goes: per task, in each process of our worker's tree and in RabbitMQ.

Usage: ``python -m bench.cpu_split [--broker URL] [--tasks 20000] [--rounds 3] [-- WORKER ARGS]``,
e.g. ``-- -l warning`` or ``-- --prefetch-multiplier 4`` to see what a worker option costs. In a
vhost of its own, fills a fresh queue with no-op tasks, starts a ``-c 2`` worker on it (its log in
a temporary file, as in ``bench.compare``), and reads user + system CPU time from ``/proc`` for
every process of the worker's tree and for the broker's ``beam.smp`` while the worker drains the
queue. Prints one JSON line per round: tasks/s and microseconds of CPU per task for each process.

The broker's figure is only meaningful on a machine where nothing else uses that broker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.control import vhost
from bench.ours import Clockwork
from bench.procs import cpu_seconds, parent_of, tree
from bench.queues import Depth, delete, probe
from bench.scenarios import Shape, Task
from broker_svc.logging import configure_logging
from broker_svc.wire.ids import uuid4_str


def role(pid: int, root: int) -> str:
    """A name for a process of the worker's tree, from its command line."""
    if pid == root:
        return "main"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            text = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "resource_tracker" in text:
        return "resource-tracker"
    if "forkserver" in text:  # the forkserver is the main process's child, pool children are its
        return "forkserver" if parent_of(pid) == root else "child"
    return "other"


def broker_pid() -> int | None:
    out = subprocess.run(["pgrep", "-f", "beam.smp.*rabbit"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def _drained(depth: Depth) -> bool:
    return depth.ready == 0  # as bench.compare's drain: the prefetch in flight (2) is left out


def one_round(url: str, tasks: int, worker_args: list[str]) -> dict[str, object]:
    queue = f"cpu-split-{uuid4_str()[:8]}"
    subject = Clockwork(url, extra_worker_args=worker_args)
    try:
        subject.fill(queue, tasks, Task.NOOP)
        broker = broker_pid()
        with probe(url) as queue_probe, subject.worker(queue, Shape.PAIR) as proc:

            def alive() -> bool:
                return proc.poll() is None

            queue_probe.wait(queue, lambda d: d.ready < tasks, timeout_s=120, what="start", alive=alive)
            pids = tree(proc.pid)
            before = {pid: cpu_seconds(pid) for pid in pids}
            broker_before = cpu_seconds(broker) if broker else 0.0
            started = time.perf_counter()
            left = queue_probe.depth(queue).ready
            queue_probe.wait(queue, _drained, timeout_s=300, what="drain", alive=alive)
            seconds = time.perf_counter() - started
            done = left  # the tasks drained while the CPU was being counted
            per_task = {
                f"{role(pid, proc.pid)}[{pid}]": round((cpu_seconds(pid) - before[pid]) / done * 1e6, 1)
                for pid in pids
            }
            if broker:
                per_task["rabbitmq"] = round((cpu_seconds(broker) - broker_before) / done * 1e6, 1)
        return {"tasks_per_s": round(done / seconds, 1), "cpu_us_per_task": per_task, "tasks": done}
    finally:
        delete(url, [queue])


def main() -> int:
    argv = sys.argv[1:]
    worker_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__)
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    )
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(own)
    configure_logging("warning")
    # A vhost of its own: the worker declares dead-letter queues, exchanges and control streams
    # beside the task queue, and deleting the vhost takes them all away.
    with vhost(args.broker) as url:
        for _ in range(args.rounds):
            print(json.dumps(one_round(url, args.tasks, worker_args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
