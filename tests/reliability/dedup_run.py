"""One keyed-dedup stress run on a real broker (RELIABILITY.md, K1-K2), and what it journaled.

:func:`run_stress` starts the workers (task events on, so the gates send ``dedup-*`` events) and
the producer processes (``dedup_producer.py``), kills a worker's whole process tree on a schedule
when the plan says so (a gate and a worker that is not one in turn, each replaced by a new
worker), waits until every call is answered and every gate holds no key, then reads the journals
into the checker's records (``dedup_check.py``). The events are read from a queue of the run's own
bound to ``celeryev`` with ``dedup.#``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from broker_svc import App, Settings
from broker_svc.wire.records.dedup import GATE_SHARDS
from tests.reliability.dedup_check import DedupVerdict, Kill, Mark, Sent, check
from tests.reliability.dedup_replay import GateEvent
from tests.reliability.dedup_stress_tasks import JOURNAL_DIR_ENV
from tests.support.amqp import channel
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess

__all__ = ["Journals", "Plan", "Stress", "load", "run_stress"]

APP = "tests.reliability.dedup_stress_tasks:app"
QUEUE = "dedup-stress"
EVENTS_QUEUE = "dedup-stress-events"
DECISIONS = ("accepted", "blocked", "declined", "duplicate", "released", "evicted")


@dataclass(frozen=True, slots=True)
class Plan:
    """The size of a run: ``producers`` x ``bursts`` x ``burst_size`` requests; ``kills`` kills,
    one every ``kill_every_s`` from the first burst (none by default)."""

    producers: int = 8
    bursts: int = 1
    burst_size: int = 150
    period_s: float = 0.0
    workers: int = 4
    concurrency: int = 2
    dedup_timeout_s: float = 60.0
    kills: int = 0
    kill_every_s: float = 10.0
    kill_offset_s: float = 0.0  # after the kill's multiple of ``kill_every_s``: into a burst
    seed: int = 18
    results_timeout_s: float = 120.0


@dataclass(slots=True)
class Stress:
    """What a run journaled, the checker's verdict and the run's own figures."""

    verdict: DedupVerdict
    figures: dict[str, Any] = field(default_factory=dict)
    kills: list[Kill] = field(default_factory=list)


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    for line in path.read_text().splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill is not a record


class _Events:
    """The run's own queue of ``dedup-*`` events, read as they come."""

    def __init__(self, url: str) -> None:
        self._url = url
        self.events: list[GateEvent] = []
        with channel(url) as ch:
            ch.exchange_declare("celeryev", exchange_type="topic", durable=True)
            ch.queue_declare(EVENTS_QUEUE)
            ch.queue_bind(EVENTS_QUEUE, "celeryev", routing_key="dedup.#")

    def read(self) -> list[GateEvent]:
        with channel(self._url) as ch:
            while True:
                method, _, body = ch.basic_get(EVENTS_QUEUE, auto_ack=True)
                if method is None:
                    return self.events
                decoded = json.loads(body)
                for event in decoded if isinstance(decoded, list) else [decoded]:
                    self.events.append(
                        GateEvent(
                            decision=str(event["type"]).removeprefix("dedup-"),
                            task_id=event["uuid"],
                            key=event["key"],
                            hostname=event["hostname"],
                            clock=int(event.get("clock", 0)),
                        )  # fmt: skip
                    )

    def counts(self, hostname: str) -> dict[str, int]:
        seen = Counter(e.decision for e in self.events if e.hostname == hostname)
        return {decision: seen[decision] for decision in DECISIONS}


def _gate_shards(worker: WorkerProcess) -> frozenset[int]:
    return frozenset(int(e["shard"]) for e in worker.events() if e.get("event") == "dedup_gate_active")


class _Fleet:
    """The run's workers: the live ones, and every one started (for their logs)."""

    def __init__(self, url: str, plan: Plan, journal_dir: Path, stack: ExitStack) -> None:
        self._url, self._plan, self._journal_dir, self._stack = url, plan, journal_dir, stack
        self.live: list[WorkerProcess] = []
        self.started: list[WorkerProcess] = []
        self._rng = random.Random(plan.seed)

    def start(self) -> WorkerProcess:
        worker = WorkerProcess(
            self._url, app=APP, queues=[QUEUE], concurrency=self._plan.concurrency, extra_args=["-E"],
            env={JOURNAL_DIR_ENV: str(self._journal_dir)},
        )  # fmt: skip
        self._stack.enter_context(worker)
        self.live.append(worker)
        self.started.append(worker)
        return worker

    def kill(self, number: int) -> Kill:
        """SIGKILL a worker's tree (a gate on even ``number``, another worker on odd, when there is
        one: with the shards spread, every worker is usually a gate), start another."""
        gates = [w for w in self.live if _gate_shards(w)]
        others = [w for w in self.live if w not in gates]
        victim = self._rng.choice((gates if number % 2 == 0 else others) or self.live)
        shards = _gate_shards(victim)
        pids = victim.signal_tree(signal.SIGKILL)
        at = time.time()
        victim.proc.wait(timeout=30)
        self.live.remove(victim)
        self.start().wait_ready()
        return Kill(at=at, pids=frozenset(pids), worker=victim.name, gate_shards=shards)


def _until(instant: float, why: str) -> None:
    # Pacing: the schedule's next instant on the wall clock.
    wait_for(lambda: time.time() >= instant, timeout_s=max(0.0, instant - time.time()) + 5, message=why)


@contextmanager
def _producers(
    url: str, plan: Plan, directory: Path, start_at: float
) -> Iterator[list[subprocess.Popen[str]]]:
    procs = []
    try:
        for index in range(plan.producers):
            cmd = [
                sys.executable, "-m", "tests.reliability.dedup_producer", "--url", url,
                "--journal", str(directory / f"producer-{index}.jsonl"), "--queue", QUEUE,
                "--producer", str(index), "--seed", str(plan.seed), "--bursts", str(plan.bursts),
                "--burst-size", str(plan.burst_size), "--period-s", str(plan.period_s),
                "--start-at", str(start_at), "--dedup-timeout", str(plan.dedup_timeout_s),
                "--results-timeout-s", str(plan.results_timeout_s),
            ]  # fmt: skip
            out = (directory / f"producer-{index}.out").open("w")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True))
            out.close()
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _spread(client: App, fleet: _Fleet) -> bool:
    # Every shard active on the worker that owns it: the shards move no more while nobody dies.
    names = [w.name for w in fleet.live]
    stats = client.control.inspect(destination=names, timeout=5).dedup()
    if any(name not in stats for name in names):
        return False
    if any(stats[name]["active_shards"] != stats[name]["owned_shards"] for name in names):
        return False
    return sorted(s for name in names for s in stats[name]["active_shards"]) == list(range(GATE_SHARDS))


def _drained(client: App, fleet: _Fleet, events: _Events) -> bool:
    # Every live gate holds no key, and every decision it counted has its event here.
    names = [w.name for w in fleet.live]
    stats = client.control.inspect(destination=names, timeout=5).dedup()
    events.read()
    for name in names:
        mine = stats.get(name)
        if mine is None or mine["keys"] or mine["waiting"]:
            return False
        if events.counts(name) != {decision: mine[decision] for decision in DECISIONS}:
            return False
    return True


class Journals(NamedTuple):
    """A run's records, as the checker takes them."""

    sends: list[Sent]
    outcomes: dict[str, str]
    marks: list[Mark]
    events: list[GateEvent]
    kills: list[Kill]


def load(directory: Path) -> Journals:
    """Read the journals a run left in ``directory`` (after the run, or for a post-mortem)."""
    sends: list[Sent] = []
    outcomes: dict[str, str] = {}
    for path in sorted(directory.glob("producer-*.jsonl")):
        for line in _lines(path):
            if line["event"] == "sent":
                sends.append(Sent(line["key"], line["id"], float(line["at"])))
            else:
                outcomes[line["id"]] = line["state"]
    marks = [
        Mark(line["event"], line["key"], line["id"], int(line["pid"]), float(line["at"]),
             bool(line.get("redelivered")))
        for path in sorted((directory / "runs").glob("*.jsonl"))
        for line in _lines(path)
    ]  # fmt: skip
    events = [GateEvent(**line) for line in _lines(directory / "events.jsonl")]
    kills = [
        Kill(float(line["at"]), frozenset(line["pids"]), line["worker"], frozenset(line["gate_shards"]))
        for line in _lines(directory / "kills.jsonl")
    ]
    return Journals(sends, outcomes, marks, events, kills)


def run_stress(url: str, directory: Path, plan: Plan) -> Stress:
    """Run ``plan`` against the vhost of ``url`` and check it; files go under ``directory``.

    Raises:
        AssertionError: a worker or producer did not start or finish within its deadline.
    """
    journal_dir = directory / "runs"
    journal_dir.mkdir(parents=True)
    events = _Events(url)
    kills: list[Kill] = []
    with ExitStack() as stack:
        client = stack.enter_context(App("dedup-stress-check", settings=Settings(broker_url=url)))
        fleet = _Fleet(url, plan, journal_dir, stack)
        for worker in [fleet.start() for _ in range(plan.workers)]:
            worker.wait_ready()
        # Before the first send: a run without kills is exact, one gate per shard throughout.
        wait_for(lambda: _spread(client, fleet), timeout_s=60, interval_s=0.5,
                 message="the gate shards spread over the workers")  # fmt: skip
        start_at = time.time() + 5.0  # the producers' imports and connections, on a busy machine
        procs = stack.enter_context(_producers(url, plan, directory, start_at))
        for number in range(plan.kills):
            _until(start_at + (number + 1) * plan.kill_every_s + plan.kill_offset_s, f"kill {number + 1}")
            kills.append(fleet.kill(number))
        for index, proc in enumerate(procs):
            rest = start_at + plan.bursts * plan.period_s + plan.results_timeout_s + 30 - time.time()
            code = proc.wait(timeout=max(rest, 30))
            output = (directory / f"producer-{index}.out").read_text()
            assert code == 0, f"producer {index} exited with {code}:\n{output[-3000:]}"
        drained_by = plan.dedup_timeout_s + 60
        wait_for(lambda: _drained(client, fleet, events), timeout_s=drained_by, interval_s=0.5,
                 message="every live gate holds no key and its events are read")  # fmt: skip
        gate_logs = {w.name: w.events() for w in fleet.started}
        logs = directory / "workers"
        logs.mkdir()
        for worker in fleet.started:  # kept for a post-mortem: WorkerProcess deletes its own
            (logs / f"{worker.name}.log").write_text(worker.log_text())
    with (directory / "events.jsonl").open("w") as out:  # kept for a post-mortem, as the logs
        out.writelines(json.dumps(asdict(event)) + "\n" for event in events.events)
    with (directory / "kills.jsonl").open("w") as out:
        out.writelines(json.dumps(asdict(kill), default=sorted) + "\n" for kill in kills)
    journals = load(directory)
    verdict = check(journals.sends, journals.outcomes, journals.marks, journals.events, kills=journals.kills)
    ends = [m.at for m in journals.marks if m.event == "end"]
    figures: dict[str, Any] = {
        "producers": plan.producers,
        "workers": plan.workers,
        "concurrency": plan.concurrency,
        "dedup_timeout_s": plan.dedup_timeout_s,
        "run_s": round(max(ends, default=start_at) - start_at, 2),
        "gate_resubscribes": sum(
            1 for log in gate_logs.values() for e in log if e.get("event") == "dedup_gate_resubscribing"
        ),
        "events_not_sent": sum(
            1 for log in gate_logs.values() for e in log if e.get("event") == "event_not_sent"
        ),
    }
    if kills:
        figures |= {"kills": len(kills), "gate_kills": sum(1 for k in kills if k.gate_shards)}
    return Stress(verdict=verdict, figures=figures, kills=kills)
