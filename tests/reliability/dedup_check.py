"""The keyed-dedup stress runs' checker (RELIABILITY.md, K1-K2): the gate's promises, from journals (pure).

Inputs: every send (key, task id, wall time just before it), every call's outcome, the task's
``start``/``end`` lines, the gates' ``dedup-*`` events, and the kills the run made. :func:`check`
returns the figures and the list of broken promises (empty when the run is good):

- **one running per key**: no two runs of a key overlap in time; a run with a start and no end
  runs until the kill of its process (one that no kill explains never ends, and overlaps all after);
- **one waiting per key**: the events replay through the gate's model (``dedup_replay.py``) with
  every verdict equal to the model's;
- **every request answered**: each call ended SUCCESS or DECLINED; a SUCCESS ran, a DECLINED
  never did; no run of a task nobody sent; a task runs again only after a kill ended its run;
- **no lost final update**: per key, a run that finished started after the key's last send;
- **declines counted exactly**: the model's declines == dedup-declined events == DECLINED calls.

Without kills everything is exact: each call has one arrival event, one gate per shard, no run
twice, and every head ends (released or evicted). With kills too, every call has an arrival event
and every head an end event: a gate publishes its events in the commit of the decisions they
tell of. What kills allow is a call decided again (its first gate died before committing) and
shards that moved between gates.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.dedup_replay import GateEvent, Replay, replay

__all__ = ["DedupVerdict", "Kill", "Mark", "Run", "Sent", "check", "runs_of"]

ANSWERS = ("SUCCESS", "DECLINED")


@dataclass(frozen=True, slots=True)
class Sent:
    """One send, journaled by its producer just before it."""

    key: str
    task_id: str
    at: float


@dataclass(frozen=True, slots=True)
class Mark:
    """One line of the task's journal: ``event`` is ``start`` or ``end``."""

    event: str
    key: str
    task_id: str
    pid: int
    at: float
    redelivered: bool = False  # (start) the delivery said it was not the first


@dataclass(frozen=True, slots=True)
class Kill:
    """A SIGKILL of a worker's whole process tree; ``gate_shards``: the shards it was the gate of."""

    at: float
    pids: frozenset[int]
    worker: str = ""
    gate_shards: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class Run:
    """One run of a task: ``end`` None if it never ended; ``killed_at`` the first kill of its
    process after it started (it ended the run if there is no ``end``)."""

    key: str
    task_id: str
    pid: int
    start: float
    end: float | None
    killed_at: float | None = None
    redelivered: bool = False

    @property
    def until(self) -> float:
        """When it stopped running: its end, else its kill, else never."""
        if self.end is not None:
            return self.end
        return self.killed_at if self.killed_at is not None else math.inf


@dataclass(slots=True)
class DedupVerdict:
    """The figures of one run and every broken promise (``problems``)."""

    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, what: str, items: Sequence[object] = ()) -> None:
        shown = f" (e.g. {list(items)[:5]})" if items else ""
        self.problems.append(what + shown)


def runs_of(marks: Iterable[Mark], kills: Sequence[Kill] = ()) -> list[Run]:
    """Pair each process's ``start`` and ``end`` lines into runs; an unended run ends at its kill."""
    runs: list[Run] = []
    open_runs: dict[tuple[int, str], Mark] = {}

    def run(start: Mark, end: float | None) -> Run:
        killed = min((k.at for k in kills if start.pid in k.pids and k.at >= start.at), default=None)
        return Run(start.key, start.task_id, start.pid, start.at, end, killed, start.redelivered)

    for mark in sorted(marks, key=lambda m: (m.pid, m.at, m.event != "end")):
        slot = (mark.pid, mark.task_id)
        if mark.event == "start":
            if slot in open_runs:
                runs.append(run(open_runs[slot], None))
            open_runs[slot] = mark
        elif (start := open_runs.pop(slot, None)) is not None:
            runs.append(run(start, mark.at))
    runs.extend(run(start, None) for start in open_runs.values())
    return sorted(runs, key=lambda r: (r.start, r.pid))


def _overlaps(runs: Sequence[Run]) -> list[tuple[str, str, str]]:
    # Runs are in start order: each must start once every earlier run of its key has stopped.
    found = []
    latest: dict[str, Run] = {}
    for run in runs:
        before = latest.get(run.key)
        if before is not None and run.start < before.until:
            found.append((run.key, before.task_id, run.task_id))
        if before is None or run.until > before.until:
            latest[run.key] = run
    return found


def check(
    sends: Sequence[Sent],
    outcomes: Mapping[str, str],
    marks: Iterable[Mark],
    events: Iterable[GateEvent],
    *,
    kills: Sequence[Kill] = (),
) -> DedupVerdict:
    """Check one run (see the module docstring); exact when there were no ``kills``.

    Args:
        sends: every send of every producer.
        outcomes: each call's final state, by task id (a call with none is lost).
        marks: the task's journal lines, from every process.
        events: the gates' dedup events, in the order they were received.
        kills: the kills the run made, in order.

    Returns:
        The figures and the broken promises.
    """
    verdict = DedupVerdict()
    exact = not kills
    key_of = {s.task_id: s.key for s in sends}
    runs = runs_of(marks, kills)
    done = [r for r in runs if r.end is not None]
    states = Counter(outcomes.get(s.task_id, "NO_OUTCOME") for s in sends)
    succeeded = {i for i in key_of if outcomes.get(i) == "SUCCESS"}
    declined = {i for i in key_of if outcomes.get(i) == "DECLINED"}
    ran = Counter(r.task_id for r in runs)
    found = replay(events, key_of=key_of)

    # Every request answered, each as it should be.
    if unanswered := [i for i in key_of if outcomes.get(i) not in ANSWERS]:
        verdict.fail(f"{len(unanswered)} calls not SUCCESS or DECLINED: {dict(states)}", unanswered)
    if never_ran := sorted(succeeded - {r.task_id for r in done}):
        verdict.fail(f"{len(never_ran)} SUCCESS calls with no finished run", never_ran)
    if declined_ran := sorted(declined & ran.keys()):
        verdict.fail(f"{len(declined_ran)} DECLINED calls ran", declined_ran)
    if foreign := sorted(ran.keys() - key_of.keys()):
        verdict.fail(f"{len(foreign)} tasks ran that nobody sent", foreign)
    if mislabelled := sorted({r.task_id for r in runs if key_of.get(r.task_id, r.key) != r.key}):
        verdict.fail(f"{len(mislabelled)} runs journaled under another key", mislabelled)
    # A run again is allowed only once the process of the run before was killed (before its ack:
    # the broker redelivers the head), and it must be marked redelivered.
    reruns, unexplained, unmarked = 0, [], []
    by_id: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_id[run.task_id].append(run)
    for task_id, each in by_id.items():
        reruns += len(each) - 1
        for before, again in zip(each, each[1:], strict=False):
            if before.killed_at is None or again.start < before.killed_at:
                unexplained.append(task_id)
            if not again.redelivered:
                unmarked.append(task_id)
    if unexplained:
        verdict.fail(f"{len(unexplained)} tasks ran again with no kill of the run before", unexplained)
    if unmarked:
        verdict.fail(f"{len(unmarked)} tasks ran again unmarked (not redelivered)", unmarked)
    # A first run is marked only if a kill handed its delivery back before it started.
    marked_first = sorted(each[0].task_id for each in by_id.values() if each[0].redelivered)
    if exact and marked_first:
        verdict.fail(f"{len(marked_first)} first runs marked redelivered without a fault", marked_first)
    if unended := [r.task_id for r in runs if r.end is None and r.killed_at is None]:
        verdict.fail(f"{len(unended)} runs never ended and no kill explains it", unended)
    # One running per key.
    if overlaps := _overlaps(runs):
        verdict.fail(f"{len(overlaps)} pairs of runs of one key overlap", overlaps)
    # No lost final update.
    last_send: dict[str, float] = {}
    for s in sends:
        last_send[s.key] = max(last_send.get(s.key, 0.0), s.at)
    last_start: dict[str, float] = {}
    for r in done:
        last_start[r.key] = max(last_start.get(r.key, 0.0), r.start)
    if lost_final := sorted(k for k, at in last_send.items() if last_start.get(k, 0.0) <= at):
        verdict.fail(f"{len(lost_final)} keys lost their final update", lost_final)
    # One waiting per key: the model agrees with every logged verdict.
    if found.mismatch_count:
        verdict.fail(f"{found.mismatch_count} events the model disagrees with", found.mismatches)
    if found.max_tails > 1:
        verdict.fail(f"the model held {found.max_tails} tails for one key")
    declined_events = found.ids("declined")
    if found.model["declined"] != found.events["declined"] or declined_events - declined:
        verdict.fail(
            f"declines: model {found.model['declined']}, events {found.events['declined']},"
            f" calls {len(declined)}",
            sorted(declined_events - declined),
        )
    # Each head ends once (released or evicted), and only a call that succeeded was a head.
    if twice := sorted(i for i, n in found.endings.items() if n > 1):
        verdict.fail(f"{len(twice)} heads ended more than once", twice)
    if not_run := sorted(found.endings.keys() - succeeded):
        verdict.fail(f"{len(not_run)} heads ended that are not SUCCESS calls", not_run)
    missing = sorted(set(key_of) - set(found.arrivals))
    unended = sorted(succeeded - found.endings.keys())
    if exact:
        _exact(verdict, found, succeeded, declined, missing)
        if unended:
            verdict.fail(f"{len(unended)} SUCCESS calls whose head never ended", unended)
    else:  # a killed gate told everything it committed (gate_shard.py: events in the commit)
        for what, ids in (("calls with no arrival event", missing), ("heads with no end event", unended)):
            if ids:
                verdict.fail(f"{len(ids)} {what}, though a gate commits its events", ids)
    verdict.figures = {
        "requests": len(sends),
        "keys": len(last_send),
        "outcomes": dict(states),
        "accepted": found.events["accepted"],
        "blocked": found.events["blocked"],
        "declined": found.events["declined"],
        "duplicate": found.events["duplicate"],
        "released": found.events["released"],
        "evicted": found.events["evicted"],
        "runs": len(runs),
        "reruns": reruns,
        "overlaps": len(overlaps),
        "lost_final_updates": len(lost_final),
        "model_mismatches": found.mismatch_count,
        "max_waiting_per_key": found.max_tails,
    }
    if kills:
        verdict.figures |= {
            "killed_runs": sum(1 for r in runs if r.end is None),
            "first_runs_marked": len(marked_first),
            "recovery_s": _recovery(kills, sends, done, succeeded),
            "shard_takeovers": sum(len(gates) - 1 for gates in found.gates.values()),
            "keys_moved_to_next_gate": found.takeovers,
            "seeded_heads": found.seeded_heads,
            "calls_without_arrival_event": len(missing),
            "heads_without_end_event": len(unended),
            "declines_without_event": len(declined - declined_events),
        }
    return verdict


def _recovery(
    kills: Sequence[Kill], sends: Sequence[Sent], done: Sequence[Run], succeeded: set[str]
) -> list[float]:
    # Per kill: seconds until every call sent before it and not yet done had its last run done.
    last_end: dict[str, float] = {}
    for run in done:
        last_end[run.task_id] = max(last_end.get(run.task_id, 0.0), run.until)
    recovery = []
    for kill in kills:
        pending = [last_end.get(s.task_id, 0.0) for s in sends if s.at < kill.at and s.task_id in succeeded]
        recovery.append(round(max([end - kill.at for end in pending if end > kill.at], default=0.0), 2))
    return recovery


def _exact(
    verdict: DedupVerdict, found: Replay, succeeded: set[str], declined: set[str], missing: list[str]
) -> None:
    # No faults: nothing may be lost or decided twice, and one gate keeps each shard.
    if missing:
        verdict.fail(f"{len(missing)} calls with no arrival event", missing)
    if twice := sorted(i for i, seen in found.arrivals.items() if len(seen) > 1):
        verdict.fail(f"{len(twice)} calls decided more than once", twice)
    if found.ids("declined") != declined or found.model["declined"] != len(declined):
        verdict.fail(
            f"declines: model {found.model['declined']}, events {found.events['declined']},"
            f" calls {len(declined)}"
        )
    if found.ids("accepted") | found.ids("blocked") != succeeded:
        verdict.fail("the calls accepted or blocked are not the SUCCESS calls")
    if moved := {s: g for s, g in found.gates.items() if len(g) > 1}:
        verdict.fail(f"shards decided by more than one gate: {moved}")
    if found.takeovers or found.seeded_heads:
        verdict.fail(f"{found.takeovers} takeovers, {found.seeded_heads} seeded heads without a fault")
