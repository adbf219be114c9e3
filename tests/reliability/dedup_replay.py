"""Replay the gates' ``dedup-*`` events through the gate's own state machine, key by key (pure).

Each event is a decision a gate committed (``worker/single_active/gate_shard.py`` publishes it in
the commit, in commit order). Per key, :func:`replay` feeds the events to a ``GateKeys`` (the model)
and compares each logged verdict with the model's: a gate that blocked where the model declines
would hold two waiting tasks for one key. A release or eviction must end the model's head.

A shard moves to another gate when its gate dies or hands it over (the shards are spread over the
live workers, so one may also come back to a gate that had it before), and the next gate starts
from what the broker holds: heads from their unacked markers (no event), tails from their held
arrivals (decided again, with events). So when a key's events move to another gate (a takeover),
the model starts again, and a head that gate learned from a marker is seeded from its first event:

- ``blocked``: it had a head, id unknown until that head's ``released``/``evicted`` names it;
- ``released``/``evicted``: it had that head, and no tail (tails replay after releases);
- ``promoted``: told right after the ending that sent it on; it is then the model's head;
- anything else: nothing seeded; ``declined`` then mismatches (a gate sets a tail only by
  ``blocked``, whose event comes first), as it must.

Seeding happens at a takeover, and for a key first seen on a shard's later gate, never for a key
first seen on the shard's first gate: there, as in a run without faults, the model starts empty
and the replay is exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from broker_svc.wire.records.dedup import shard_of
from worker.single_active.gate_keys import GateKeys, Verdict

__all__ = ["ARRIVALS", "ENDINGS", "GateEvent", "Replay", "replay"]

ARRIVALS = {v.value: v for v in Verdict}  # accepted, blocked, declined, duplicate
ENDINGS = ("released", "evicted")
_UNKNOWN_HEAD = "?"  # a head a later gate learned from its marker, not yet named by an event
_NEVER = 1e12  # the model's timeouts: evictions come from the events, not the model's clock


@dataclass(frozen=True, slots=True)
class GateEvent:
    """One ``dedup-<decision>`` event: ``decision`` is the part after ``dedup-``."""

    decision: str
    task_id: str
    key: str
    hostname: str
    clock: int = 0


@dataclass(slots=True)
class Replay:
    """What the replay found.

    Attributes:
        events: events replayed, per decision.
        model: the model's verdicts and endings, per decision (equal to ``events`` when it agrees).
        mismatches: each event the model disagrees with, described (first 50).
        mismatch_count: all of them.
        takeovers: times a key's events moved to another gate.
        seeded_heads: heads a later gate held that no event of its own had made (see above).
        max_tails: the most tails the model held for one key (never more than one).
        arrivals: per task id, the decisions of its arrival events, in order.
        endings: per task id, its ``released`` and ``evicted`` events.
        gates: per shard, the gates that sent its events, in order of their first event.
    """

    events: Counter[str] = field(default_factory=Counter)
    model: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    mismatch_count: int = 0
    takeovers: int = 0
    seeded_heads: int = 0
    max_tails: int = 0
    arrivals: dict[str, list[str]] = field(default_factory=dict)
    endings: Counter[str] = field(default_factory=Counter)
    gates: dict[int, list[str]] = field(default_factory=dict)

    def mismatch(self, what: str) -> None:
        self.mismatch_count += 1
        if len(self.mismatches) < 50:
            self.mismatches.append(what)

    def ids(self, decision: str) -> set[str]:
        """Task ids with at least one arrival event of ``decision``."""
        return {task_id for task_id, seen in self.arrivals.items() if decision in seen}


def replay(events: Iterable[GateEvent], *, key_of: Mapping[str, str]) -> Replay:
    """Replay ``events`` (in the order they were received) through one model per key.

    Args:
        events: the gates' dedup events.
        key_of: every sent task id's key (a head named by an event must be a request of its key).

    Returns:
        The counts and the events the model disagrees with.
    """
    found = Replay()
    models: dict[str, GateKeys[None]] = {}
    gate_of: dict[str, str] = {}
    for event in events:
        found.events[event.decision] += 1
        gates = found.gates.setdefault(shard_of(event.key), [])
        if event.hostname not in gates:
            gates.append(event.hostname)
        model = models.get(event.key)
        if model is None or gate_of[event.key] != event.hostname:
            takeover = model is not None
            found.takeovers += takeover
            model = models[event.key] = GateKeys()
            gate_of[event.key] = event.hostname
            if takeover or gates[0] != event.hostname:  # back at a gate that had it before, too
                _seed(model, event, found)
        if event.decision in ARRIVALS:
            _arrive(model, event, found)
        elif event.decision in ENDINGS:
            found.endings[event.task_id] += 1
            _end(model, event, found, key_of)
        elif event.decision == "promoted":
            # Told right after the ending that promoted it: the model's new head must be this one.
            if model.head_of(event.key) != event.task_id:
                found.mismatch(
                    f"{event.key}: promoted {event.task_id}, the model's head is {model.head_of(event.key)}"
                )
        else:
            found.mismatch(f"{event.key}: unknown decision {event.decision!r} ({event.task_id})")
        found.max_tails = max(found.max_tails, model.waiting())
    return found


def _seed(model: GateKeys[None], event: GateEvent, found: Replay) -> None:
    # The first event of a key at a later gate: what that gate held from the broker.
    if event.decision == Verdict.BLOCK.value:
        model.marker(event.key, _UNKNOWN_HEAD, None, deadline=_NEVER)
    elif event.decision in ENDINGS:
        model.marker(event.key, event.task_id, None, deadline=_NEVER)
    else:
        return
    found.seeded_heads += 1


def _arrive(model: GateKeys[None], event: GateEvent, found: Replay) -> None:
    found.arrivals.setdefault(event.task_id, []).append(event.decision)
    expected = model.arrive(event.key, event.task_id, None, timeout_s=_NEVER, now=0.0)
    found.model[expected.value] += 1
    if expected.value != event.decision:
        found.mismatch(
            f"{event.key}: {event.hostname} {event.decision} {event.task_id}, the model {expected.value}"
            f" (head {model.head_of(event.key)}, tail {model.tail_of(event.key)})"
        )


def _end(model: GateKeys[None], event: GateEvent, found: Replay, key_of: Mapping[str, str]) -> None:
    head = ending = model.head_of(event.key)
    if (
        head == _UNKNOWN_HEAD
        and key_of.get(event.task_id) == event.key
        and event.task_id != model.tail_of(event.key)
    ):
        head = event.task_id  # the head that gate learned from its marker, named now
    if head != event.task_id or ending is None:
        found.mismatch(f"{event.key}: {event.hostname} {event.decision} {event.task_id}, the head is {head}")
        return
    if event.decision == "released":
        model.release(event.key, ending, now=0.0)
    else:
        # At the head's own deadline: the tail it promotes gets a later one and stays the head.
        deadline = model.next_deadline()
        assert deadline is not None
        model.expired(deadline)
    found.model[event.decision] += 1
