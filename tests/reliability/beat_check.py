"""The scheduler fault tests' checker: each scheduled instant run exactly once, with its id (pure).

:func:`check_runs` reads what ``beat.tick`` journaled (``tests/support/beats.py:runs``) and counts
the instants missed and run twice between the first run and the last, the runs whose task id is
not ``fire_id(entry, scheduled)``, and runs of another entry. :func:`lateness` splits the
``beat_fired`` log events into catch-up fires (due before their leader's term began: they fell in
a failover's gap) and the rest.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from broker_svc.schedules import fire_id

__all__ = ["BeatVerdict", "Fired", "check_runs", "lateness", "quantiles"]


@dataclass(frozen=True, slots=True)
class BeatVerdict:
    """What the runs journal says about one entry of a fixed period."""

    runs: int
    seconds: float  # from the first scheduled instant run to the last
    missed: int  # instants between the first and last run that never ran
    doubled: int  # runs beyond the first of an instant
    wrong_ids: int  # runs whose id is not fire_id(entry, scheduled)
    foreign: int  # runs of another entry, or not fired by the scheduler

    @property
    def ok(self) -> bool:
        return self.runs > 0 and self.missed == self.doubled == self.wrong_ids == self.foreign == 0


@dataclass(frozen=True, slots=True)
class Fired:
    """One ``beat_fired`` log event, with the start of the term of the process that logged it."""

    scheduled: float
    late_s: float
    term_started: float


def check_runs(runs: Iterable[Mapping[str, Any]], *, entry: str, period_s: float) -> BeatVerdict:
    """Count missed, doubled and misnamed runs of ``entry`` (every ``period_s`` seconds).

    Instants are compared in whole milliseconds, as ``fire_id`` names them.
    """
    mine, foreign = [], 0
    for run in runs:
        if run.get("entry") == entry and run.get("scheduled") is not None and run.get("run_now") is None:
            mine.append(run)
        else:
            foreign += 1
    if not mine:
        return BeatVerdict(runs=0, seconds=0.0, missed=0, doubled=0, wrong_ids=0, foreign=foreign)
    counts = Counter(round(float(run["scheduled"]) * 1000) for run in mine)
    first, last = min(counts), max(counts)
    step = round(period_s * 1000)
    expected = range(first, last + 1, step)
    missed = sum(1 for instant in expected if instant not in counts)
    # An instant off the grid counts as run once too many: nothing should fire there.
    off_grid = sum(n for instant, n in counts.items() if (instant - first) % step)
    doubled = sum(n - 1 for n in counts.values()) + off_grid
    wrong_ids = sum(1 for run in mine if run.get("id") != fire_id(entry, float(run["scheduled"])))
    return BeatVerdict(
        runs=len(mine),
        seconds=(last - first) / 1000,
        missed=missed,
        doubled=doubled,
        wrong_ids=wrong_ids,
        foreign=foreign,
    )


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max (nearest rank), rounded to milliseconds; empty for no values."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    return {"n": len(ordered), "p50_s": round(rank(0.5), 3), "p99_s": round(rank(0.99), 3),
            "max_s": round(ordered[-1], 3)}  # fmt: skip


def lateness(fires: Iterable[Fired]) -> dict[str, dict[str, float]]:
    """Fire lateness quantiles: of every fire, and of the fires that were not catch-ups."""
    fires = list(fires)
    steady = [f.late_s for f in fires if f.scheduled >= f.term_started]
    return {"all": quantiles([f.late_s for f in fires]), "steady": quantiles(steady)}
