"""Keyed dedup (issue 18): its cost per task, and throughput at 0 % and 90 % duplicates.

Usage: ``python -m bench.keyed_dedup [--broker URL] [--tasks 5000] [--rounds 3] [--burst 10]
[--loads plain,distinct,bursts] [--workers 1]``.

In a vhost of its own (deleted afterwards), each round runs three loads of ``--tasks`` no-op sends,
in an order that rotates from round to round, each on a fresh queue with ``--workers`` fresh
workers (``python -m worker -A bench.keyed_dedup_app:app -c 2`` each, a subprocess logging at INFO
to a temporary file, as the other benchmarks' workers):

- ``plain``: no key; every send runs. The same load without dedup for both below;
- ``distinct``: a key of its own per send (0 % duplicates): every send accepted and run;
- ``bursts``: ``--burst`` sends in a row per key (at 10, 90 % of the sends repeat a key that has
  one running or waiting): per key the first runs, the second waits and runs, the rest are
  declined.

Before the timed sends, each gate shard gets a keyed task and the queue 20 plain ones, and the
gate shards are spread: each is active on the worker that owns it (``inspect dedup``). Then the
client (``App.send_task``, pipelined confirms) sends them all and waits for every result (SUCCESS
or DECLINED). Figures:

- tasks/s: sends settled (their result or DECLINED received), from the first send to the last;
- CPU µs per send, over the same window, from ``/proc/<pid>/stat``: the workers' trees (their main
  processes, where the gates run, and their pool children), the local RabbitMQ node (the ``beam.smp``
  that ``rabbitmqctl`` talks to) and this client;
- broker operations per send: as the design counts them from the outcomes (``designed``); the
  worker main process's AMQP calls, counted in the worker (``bench/keyed_dedup_app.py``): the
  gate's publishes, acks and commits, and how long it awaited its commits; the node's global
  counters (``bench/broker_node.py``), read 1 s after the last result so the last releases are in.
  The counters are node-wide: exact only if no other vhost was connected (``other_vhosts``).

In ``bursts``, ``keys_run_more_than_twice`` lists keys that ran three times. Correct when a send
reaches the gate after its key's run ended (it finds no tail and waits): the load's first send
goes out alone while the client builds the rest, so key 0 sometimes runs its sends 0, 1 and 2.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from bench import broker_node
from bench.control import vhost
from bench.keyed_dedup_app import COUNTED, COUNTS_ENV
from bench.ours import WORKER_ARGS
from bench.procs import cpu_seconds, running, tree
from bench.queues import QueueProbe, probe
from bench.spine import NOOP
from bench.stats import Spread
from broker_svc import App, AsyncResult, Settings
from broker_svc.logging import configure_logging
from broker_svc.topology import LEGACY_NAMESPACE, dedup_gate_queue
from broker_svc.wire.records.dedup import GATE_SHARDS, shard_of

ROOT = Path(__file__).resolve().parent.parent
LOADS = ("plain", "distinct", "bursts")
WARM_PLAIN = 20
RESULT_TIMEOUT_S = 300.0


def designed(load: str, runs: int, declined: int) -> dict[str, int]:
    """The broker operations the design implies for these outcomes (docs/architecture.md,
    "Deduplication under faults").

    Without a key a send is published, delivered to a child, answered and acked. With one, the
    send goes to its gate shard; an accepted task costs the gate a publish to its queue, a head
    marker (published, delivered back, acked at the end) and the arrival's ack; the child that ran
    it publishes a release (confirmed), which the gate receives and acks. A declined send costs a
    DECLINED reply and the arrival's ack. Commits are the gate's batches: counted, not designed.
    """
    sends = runs + declined
    if load == "plain":
        return {"publishes": 2 * sends, "deliveries": 2 * sends, "acks": sends}
    # publishes: each send, the task sent on and its marker, the result, the release, each DECLINED
    # deliveries: each arrival and each reply to the client; per run, the marker, the task, the release
    # acks: each arrival; per run, the task (child), the release and the marker (gate)
    return {
        "publishes": sends + 4 * runs + declined,
        "deliveries": 2 * sends + 3 * runs,
        "acks": sends + 3 * runs,
    }


def _worker_command(url: str, queue: str, name: str) -> list[str]:
    return [
        sys.executable, "-m", "worker", "-A", "bench.keyed_dedup_app:app", "-c", "2", "-Q", queue,
        "-b", url, "-l", "info", "-n", name, *WORKER_ARGS.split(),
    ]  # fmt: skip


def _gate_counts(pid: int, path: Path) -> dict[str, float]:
    """The worker main process's AMQP calls so far (``bench/keyed_dedup_app.py``).

    Raises:
        TimeoutError: the worker did not write them within 10 s.
    """
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the worker did not write its AMQP call counts")
        time.sleep(0.01)
    counts: dict[str, float] = json.loads(path.read_text())
    return counts


def _all_gate_counts(workers: list[int], plan: Plan) -> list[dict[str, float]]:
    # Each worker's gate calls.
    return [_gate_counts(pid, plan.counts_path(index)) for index, pid in enumerate(workers)]


def _summed(each: list[dict[str, float]]) -> dict[str, float]:
    return {name: sum(counts[name] for counts in each) for name in each[0]}


def _key_per_shard(tag: str) -> list[str]:
    keys: dict[int, str] = {}
    n = 0
    while len(keys) < GATE_SHARDS:
        keys.setdefault(shard_of(f"warm-{tag}-{n}"), f"warm-{tag}-{n}")
        n += 1
    return list(keys.values())


def _ready(queue_probe: QueueProbe, queue: str, workers: int, alive: Callable[[], bool]) -> None:
    # Every child consumes the queue, and a gate is active on every shard (a single-active queue
    # counts its active consumer only: ``_spread`` then waits for every worker's share).
    queue_probe.wait(queue, lambda d: d.consumers >= 2 * workers, timeout_s=120, what="children", alive=alive)
    for shard in range(GATE_SHARDS):
        queue_probe.wait(
            dedup_gate_queue(shard, LEGACY_NAMESPACE).name,
            lambda d: d.consumers >= 1,
            timeout_s=60,
            what="gate",
            alive=alive,
        )


def _spread(app: App, names: list[str]) -> dict[str, list[int]]:
    """Wait until each shard is active on its owner; the shards each worker is active on.

    Raises:
        TimeoutError: not within 120 s.
    """
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        stats = app.control.inspect(destination=names, timeout=5).dedup()
        active = {name: stats[name]["active_shards"] for name in names if name in stats}
        settled = len(active) == len(names) and all(
            stats[name]["active_shards"] == stats[name]["owned_shards"] for name in names
        )
        if settled and sorted(s for shards in active.values() for s in shards) == list(range(GATE_SHARDS)):
            return active
        time.sleep(0.5)
    raise TimeoutError("the gate shards were not spread over the workers within 120 s")


def _own_cpu_s() -> float:
    return cpu_seconds(os.getpid())


@dataclass(frozen=True, slots=True)
class Plan:
    """One load of one round: its sends, its queue, and where its worker writes its counts."""

    load: str
    tasks: int
    burst: int
    workers: int = 1
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def queue(self) -> str:
        return f"keyed-{self.load}-{self.tag}"

    def counts_path(self, worker: int) -> Path:
        return Path(tempfile.gettempdir()) / f"bench-keyed-{self.tag}-{worker}.json"

    def worker_name(self, worker: int) -> str:
        return f"bench-{self.queue}-{worker}@%h"

    def send(self, app: App) -> list[AsyncResult[Any]]:
        """Send the load's tasks (pipelined: a call returns once its task is handed to the I/O thread)."""
        if self.load == "plain":
            return [app.send_task(NOOP, queue=self.queue) for _ in range(self.tasks)]
        if self.load == "distinct":
            keys = [f"d-{self.tag}-{i}" for i in range(self.tasks)]
        else:
            keys = [f"b-{self.tag}-{i // self.burst}" for i in range(self.tasks)]
        return [app.send_task(NOOP, queue=self.queue, dedup_key=key) for key in keys]


def one_load(url: str, plan: Plan, node_pid: int | None) -> dict[str, Any]:
    """Run one load with fresh workers on a fresh queue; its figures (module docstring)."""
    try:
        with App("bench-keyed", settings=Settings(broker_url=url)) as app, ExitStack() as stack:
            # The warm-up goes first: the client declares the queue and the gate shards as it
            # sends, so the probe below never asks for a queue that does not exist yet.
            warm = [app.send_task(NOOP, queue=plan.queue, dedup_key=k) for k in _key_per_shard(plan.tag)]
            warm += [app.send_task(NOOP, queue=plan.queue) for _ in range(WARM_PLAIN)]
            app.flush(60)
            queue_probe = stack.enter_context(probe(url))
            procs = []
            for worker in range(plan.workers):
                env = {**os.environ, COUNTS_ENV: str(plan.counts_path(worker)), "PYTHONUNBUFFERED": "1"}
                command = _worker_command(url, plan.queue, plan.worker_name(worker))
                procs.append(stack.enter_context(running(command, env=env, cwd=ROOT)))

            def alive() -> bool:
                return all(proc.poll() is None for proc in procs)

            _ready(queue_probe, plan.queue, plan.workers, alive)
            for result in warm:
                result.get(timeout=60)
            host = socket.gethostname()
            names = [plan.worker_name(worker).replace("%h", host) for worker in range(plan.workers)]
            spread = _spread(app, names)
            time.sleep(0.5)  # the warm-up's releases taken
            row = _measure(app, [proc.pid for proc in procs], plan, node_pid)
            row["active_shards"] = [len(spread[name]) for name in names]
    finally:
        for worker in range(plan.workers):
            plan.counts_path(worker).unlink(missing_ok=True)
    own_vhost = unquote(urlsplit(url).path.lstrip("/"))
    if "node_vhosts" in row:
        row["other_vhosts"] = sorted(set(row.pop("node_vhosts")) - {own_vhost})
    return row


def _settle(results: list[AsyncResult[Any]]) -> tuple[dict[str, int], int]:
    """Wait for every result: the count of each final state, and how many never came."""
    states: dict[str, int] = {}
    missing = 0
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    for result in results:
        try:
            result.get(timeout=max(0.1, deadline - time.monotonic()), propagate=False)
        except TimeoutError:  # ResultTimeout is one
            missing += 1
            continue
        states[result.state] = states.get(result.state, 0) + 1
    return states, missing


def _measure(app: App, workers: list[int], plan: Plan, node_pid: int | None) -> dict[str, Any]:
    pids = [pid for worker in workers for pid in tree(worker)]
    node_before = broker_node.read()  # outside the timed window: rabbitmqctl costs CPU
    gate_before_each = _all_gate_counts(workers, plan)
    cpu_before = {pid: cpu_seconds(pid) for pid in pids}
    node_cpu_before = cpu_seconds(node_pid) if node_pid else 0.0
    client_before = _own_cpu_s()
    load_1m = os.getloadavg()[0]

    started = time.perf_counter()
    results = plan.send(app)
    sent = time.perf_counter()
    states, missing = _settle(results)
    settled = time.perf_counter()

    cpu = {pid: cpu_seconds(pid) - cpu_before[pid] for pid in pids}
    node_cpu = (cpu_seconds(node_pid) - node_cpu_before) if node_pid else None
    client_cpu = _own_cpu_s() - client_before
    time.sleep(1.0)  # the last releases and the gate's last commit
    gate_each = _all_gate_counts(workers, plan)
    gate, gate_before = _summed(gate_each), _summed(gate_before_each)
    node_after = broker_node.read()

    runs, declined = states.get("SUCCESS", 0), states.get("DECLINED", 0)
    per = 1e6 / plan.tasks
    main_cpu = sum(cpu.get(pid, 0.0) for pid in workers)
    row: dict[str, Any] = {
        "load": plan.load,
        "workers": plan.workers,
        "tasks": plan.tasks,
        "runs": runs,
        "declined": declined,
        "other_states": {s: n for s, n in states.items() if s not in ("SUCCESS", "DECLINED")},
        "missing": missing,
        "tasks_per_s": round(plan.tasks / (settled - started), 1),
        "send_s": round(sent - started, 3),
        "seconds": round(settled - started, 3),
        "worker_us": round(sum(cpu.values()) * per, 1),
        "worker_main_us": round(main_cpu * per, 1),
        "worker_children_us": round((sum(cpu.values()) - main_cpu) * per, 1),
        "broker_us": round(node_cpu * per, 1) if node_cpu is not None else None,
        "client_us": round(client_cpu * per, 1),
        "designed": {k: round(v / plan.tasks, 2) for k, v in designed(plan.load, runs, declined).items()},
        "gate": {k: round((gate[k] - gate_before[k]) / plan.tasks, 3) for k in COUNTED},
        # How the work spread: each worker's main process (its gate) in CPU and in publishes.
        "worker_main_us_each": [round(cpu.get(pid, 0.0) * per, 1) for pid in workers],
        "gate_publishes_each": [
            round(after["basic_publish"] - before["basic_publish"])
            for before, after in zip(gate_before_each, gate_each, strict=True)
        ],
        "load_1m": round(load_1m, 2),
    }
    commits = gate["tx_commit"] - gate_before["tx_commit"]
    if commits:
        # The gate decides nothing while it awaits a commit: the share of the run it spent so.
        waited_s = gate["tx_commit_wait_s"] - gate_before["tx_commit_wait_s"]
        row["gate_commit_ms"] = round(waited_s / commits * 1000, 2)
        row["gate_commit_wait_share"] = round(waited_s / (settled - started), 2)
    if plan.load == "bursts":
        # Per key at most one runs and one waits; a send that reaches the gate after the key's
        # first run ended finds no tail and waits, so a key may run more than twice.
        ran: dict[int, list[int]] = {}
        for i, result in enumerate(results):
            if result.state == "SUCCESS":
                ran.setdefault(i // plan.burst, []).append(i % plan.burst)
        more = [[key, *positions] for key, positions in ran.items() if len(positions) > 2]
        row["keys_run_more_than_twice"] = {"keys": len(more), "key_and_positions_run": more[:5]}
    if node_before is not None and node_after is not None:
        ops = broker_node.operations(node_after.since(node_before))
        row["node"] = {k: round(v / plan.tasks, 2) for k, v in ops.items()}
        row["node_vhosts"] = sorted(node_before.vhosts | node_after.vhosts)
    return row


def _cell(values: Sequence[float], digits: int = 0) -> str:
    spread = Spread.of(values)
    fmt = f"{{:,.{digits}f}}"
    return f"{fmt.format(spread.median)} ({fmt.format(spread.low)}–{fmt.format(spread.high)})"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per load, median (min–max) over the rounds; ratios of medians to ``plain``."""
    by_load: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_load.setdefault(row["load"], []).append(row)
    plain = by_load.get("plain")
    base = Spread.of([r["tasks_per_s"] for r in plain]).median if plain else None
    lines = [
        "| load | settled/s | vs plain | worker µs/send (main + children) | RabbitMQ µs/send "
        "| client µs/send | runs / declined |",
        "|---|---|---|---|---|---|---|",
    ]
    for load, group in by_load.items():
        rate = Spread.of([r["tasks_per_s"] for r in group]).median
        ratio = f"{rate / base:.2f}×" if base else "—"
        main = Spread.of([r["worker_main_us"] for r in group]).median
        children = Spread.of([r["worker_children_us"] for r in group]).median
        broker = [r["broker_us"] for r in group if r["broker_us"] is not None]
        outcomes = " or ".join(sorted({f"{r['runs']:,} / {r['declined']:,}" for r in group}))
        lines.append(
            f"| {load} | {_cell([r['tasks_per_s'] for r in group])} | {ratio} "
            f"| {_cell([r['worker_us'] for r in group])} ({main:,.0f} + {children:,.0f}) "
            f"| {_cell(broker) if broker else '—'} | {_cell([r['client_us'] for r in group])} "
            f"| {outcomes} |"
        )
    lines += [
        "",
        "| load | designed: publishes / deliveries / acks | gate, counted: publishes / acks / commits "
        "| gate: ms per commit (share of the run awaiting commits) | node counters: publishes / "
        "deliveries / acks | loads with another vhost connected |",
        "|---|---|---|---|---|---|",
    ]
    for load, group in by_load.items():
        d = group[0]["designed"]
        gate = " / ".join(
            _cell([r["gate"][k] for r in group], 3) for k in ("basic_publish", "basic_ack", "tx_commit")
        )
        committed = [r for r in group if "gate_commit_ms" in r]
        commit = (
            f"{_cell([r['gate_commit_ms'] for r in committed], 1)} "
            f"({_cell([r['gate_commit_wait_share'] for r in committed], 2)})"
            if committed
            else "—"
        )
        nodes = [r["node"] for r in group if "node" in r]
        node = " / ".join(_cell([n[k] for n in nodes], 2) for k in ("publishes", "deliveries", "acks"))
        shared = sum(1 for r in group if r.get("other_vhosts"))
        lines.append(
            f"| {load} | {d['publishes']} / {d['deliveries']} / {d['acks']} | {gate} | {commit} "
            f"| {node or '—'} | {shared} of {len(group)} |"
        )
    lines += [
        "",
        "| load | round | shards active per worker | gate publishes per worker "
        "| main process µs/send per worker |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['load']} | {r.get('round', '')} | {r['active_shards']} | {r['gate_publishes_each']} "
        f"| {r['worker_main_us_each']} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.keyed_dedup", description=__doc__)
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument("--tasks", type=int, default=5_000, help="sends per load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--burst", type=int, default=10, help="sends per key in the bursts load")
    parser.add_argument("--loads", default=",".join(LOADS), help="which loads, comma-separated")
    parser.add_argument("--workers", type=int, default=1, help="workers per load, each with -c 2")
    args = parser.parse_args()
    configure_logging("warning")
    loads = [load for load in args.loads.split(",") if load]
    if unknown := set(loads) - set(LOADS):
        parser.error(f"unknown loads: {sorted(unknown)}")
    local = urlsplit(args.broker).hostname in ("127.0.0.1", "localhost")
    node_pid = broker_node.node_pid() if local else None
    rows = []
    started = time.monotonic()
    with vhost(args.broker) as url:
        for round_no in range(args.rounds):
            shift = round_no % len(loads)  # A B C, B C A, C A B: no load always goes first
            for load in loads[shift:] + loads[:shift]:
                row = one_load(url, Plan(load, args.tasks, args.burst, args.workers), node_pid)
                row["round"] = round_no + 1
                print(json.dumps(row), flush=True)
                rows.append(row)
    minutes = (time.monotonic() - started) / 60
    print(
        f"\n{args.rounds} rounds of {args.tasks:,} sends per load, {args.workers} worker(s),"
        f" in {minutes:.1f} min"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
