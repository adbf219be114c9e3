"""The chaos tests' journal and checker: who was published, who ran, and what went missing.

Producers record each publish (and whether the broker confirmed it) in the test process; tasks record
each execution from inside the worker's children, appending one JSON line per run with ``O_APPEND``
before the task returns (so before its ack). :func:`check` turns the two logs into Jepsen-style counts,
and :func:`report` prints them as one JSON line per test (``RELIABILITY {...}``) and appends that line
to the run's report file, for RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import poll
from tests.support.workers import DESIGN

__all__ = [
    "JOURNAL_ENV",
    "REPORT_ENV",
    "SIZES",
    "Execution",
    "Journal",
    "Verdict",
    "check",
    "record_execution",
    "report",
]

JOURNAL_ENV = "CLOCKWORK_JOURNAL_DIR"
REPORT_ENV = "CLOCKWORK_RELIABILITY_REPORT"
_DEFAULT_REPORT = Path(__file__).resolve().parents[2] / ".reliability" / "results.jsonl"
_EXECUTED = "executed.jsonl"
_PUBLISHED = "published.jsonl"

# N = 1,000 on every CI run; N = 10,000 in the nightly `pytest -m chaos` run.
SIZES = [
    pytest.param(1_000, id="n1000"),
    pytest.param(10_000, id="n10000", marks=pytest.mark.chaos),
]


@dataclass(frozen=True, slots=True)
class Execution:
    """One run of a task body, as the task journaled it."""

    task_id: str
    pid: int
    redelivered: bool
    delivery_count: int
    at: float

    @property
    def marked(self) -> bool:
        """The delivery said it was not the first: RabbitMQ's flag or a delivery count."""
        return self.redelivered or self.delivery_count >= 1


def _append_line(path: Path, record: Mapping[str, Any]) -> None:
    # One write(2) per line on an O_APPEND descriptor: lines from many processes never interleave.
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    # A process killed mid-write can leave a cut last line: it is not a record.
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def record_execution(task_id: str | None, delivery_info: Mapping[str, Any]) -> None:
    """Journal one execution; called first thing by each journaled task, inside the worker."""
    directory = os.environ.get(JOURNAL_ENV)
    if not directory or task_id is None:
        raise RuntimeError(f"journaled task ran without ${JOURNAL_ENV} or a task id")
    _append_line(
        Path(directory) / _EXECUTED,
        {
            "id": task_id,
            "pid": os.getpid(),
            "redelivered": bool(delivery_info.get("redelivered")),
            "delivery_count": int(delivery_info.get("delivery_count") or 0),
            "at": time.time(),
        },
    )


class Journal:
    """Both logs of one chaos run, in ``directory`` (created)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def env(self) -> dict[str, str]:
        """Environment for worker processes whose tasks journal into this run."""
        return {JOURNAL_ENV: str(self.directory)}

    def published(self, task_id: str, *, confirmed: bool) -> None:
        """Record one publish; ``confirmed`` is whether the broker confirmed it."""
        _append_line(self.directory / _PUBLISHED, {"id": task_id, "confirmed": confirmed})

    def publishes(self) -> dict[str, bool]:
        """Every published id, confirmed if any of its publishes was."""
        seen: dict[str, bool] = {}
        for record in _read_lines(self.directory / _PUBLISHED):
            seen[record["id"]] = seen.get(record["id"], False) or bool(record["confirmed"])
        return seen

    def executions(self) -> list[Execution]:
        """Every journaled run, in the order they were written."""
        return [
            Execution(r["id"], r["pid"], r["redelivered"], r["delivery_count"], r["at"])
            for r in _read_lines(self.directory / _EXECUTED)
        ]

    def executed_ids(self) -> set[str]:
        """Ids that ran at least once."""
        return {e.task_id for e in self.executions()}

    def wait_executed(self, ids: Iterable[str], *, timeout_s: float) -> None:
        """Wait until every one of ``ids`` ran at least once; fail with the counts at the deadline."""
        wanted = set(ids)
        if poll(lambda: wanted <= self.executed_ids(), timeout_s=timeout_s, interval_s=0.2):
            return
        missing = wanted - self.executed_ids()
        raise AssertionError(
            f"{len(missing)} of {len(wanted)} tasks never ran within {timeout_s} s"
            f" (e.g. {sorted(missing)[:3]})"
        )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Jepsen-style counts of one run.

    Attributes:
        published: distinct ids published.
        confirmed: distinct ids the broker confirmed.
        executed: distinct ids that ran.
        lost: confirmed ids that never ran (must be 0).
        duplicated: runs beyond the first of each id (allowed, bounded and marked).
        unexpected: ids that ran but were never published.
        unmarked_duplicates: repeat runs whose delivery was neither redelivered nor counted.
        max_runs: the most runs of any one id.
    """

    published: int
    confirmed: int
    executed: int
    lost: int
    duplicated: int
    unexpected: int
    unmarked_duplicates: int
    max_runs: int


def check(journal: Journal, *, expected: Iterable[str] | None = None) -> Verdict:
    """Compare what was confirmed (or ``expected``) with what ran."""
    publishes = journal.publishes()
    must_run = set(expected) if expected is not None else {i for i, ok in publishes.items() if ok}
    runs: Counter[str] = Counter()
    unmarked = 0
    for execution in journal.executions():
        runs[execution.task_id] += 1
        if runs[execution.task_id] > 1 and not execution.marked:
            unmarked += 1
    return Verdict(
        published=len(publishes),
        confirmed=sum(publishes.values()),
        executed=len(runs),
        lost=len(must_run - runs.keys()),
        duplicated=sum(n - 1 for n in runs.values()),
        unexpected=len(runs.keys() - publishes.keys() - must_run),
        unmarked_duplicates=unmarked,
        max_runs=max(runs.values(), default=0),
    )


def report(row: str, verdict: Verdict | None = None, **figures: Any) -> dict[str, Any]:
    """Print one ``RELIABILITY {json}`` line for ``row`` and append it to the run's report file.

    The record carries ``design``: ``children-consume`` (one thread per child) or ``threads``
    (``--threads N``, N > 1).

    The file is ``$CLOCKWORK_RELIABILITY_REPORT``, else ``.reliability/results.jsonl`` in the project.
    """
    # Tagged with the worker design the run's workers used (CLOCKWORK_TEST_WORKER_ARGS): the
    # summary writes each design's figures to a table of its own.
    record: dict[str, Any] = {
        "row": row,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "design": DESIGN,
    }
    test = os.environ.get("PYTEST_CURRENT_TEST")
    if test:
        record["test"] = test.rsplit(" ", 1)[0]
    if verdict is not None:
        record.update(asdict(verdict))
    record.update(figures)
    print("RELIABILITY " + json.dumps(record, sort_keys=True, default=str))
    path = Path(os.environ.get(REPORT_ENV) or _DEFAULT_REPORT)
    path.parent.mkdir(parents=True, exist_ok=True)
    _append_line(path, record)
    return record
