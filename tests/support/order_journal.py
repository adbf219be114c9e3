"""The ordered-queue tests' journal and its checker: did one task at a time run, in publish order?

Each task appends a ``start`` line before its body and an ``end`` line after it (``O_APPEND``, one
``write(2)`` per line, so lines from many processes never interleave), with its sequence number,
the node that ran it and whether its delivery was marked redelivered. :func:`check_order` reads the
lines back in file order and counts what breaks the promise of an ordered queue (docs/guide.md,
"Ordered queues"); it is pure, so its own tests feed it journals that are wrong on purpose.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.json_lines import read_json_lines

__all__ = ["OrderVerdict", "check_order", "read_journal", "record"]


def record(path: str | Path, *, phase: str, seq: int, node: str, redelivered: bool) -> None:
    """Append one ``start`` or ``end`` line for task ``seq`` (called from inside the task)."""
    line = {"phase": phase, "seq": seq, "node": node, "pid": os.getpid(), "redelivered": redelivered,
            "at": time.time()}  # fmt: skip
    data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_journal(path: str | Path) -> list[dict[str, Any]]:
    """The journal's complete lines in the order they were written (none if nothing ran yet)."""
    return read_json_lines(path)


@dataclass
class OrderVerdict:
    """What a journal says about one ordered queue.

    Attributes:
        expected: how many tasks were published (sequence numbers ``0 .. expected-1``).
        done: distinct tasks whose run ended.
        missing: published tasks that never ended a run (lost).
        overlaps: starts while another task's run had not ended and was not cut short by a kill.
        out_of_order: starts of a task that was not the next one due (a skip or a step back),
            except the allowed repeat below.
        repeats_marked: starts of a task that had started before, with the redelivered mark, as the
            first start after a failover (allowed: the one task the last consumer held).
        repeats_unmarked: starts of a task that had started before, without the mark (duplicates).
        nodes: the nodes that ran tasks, in the order they took over.
    """

    expected: int
    done: int = 0
    missing: list[int] = field(default_factory=list)
    overlaps: int = 0
    out_of_order: int = 0
    repeats_marked: int = 0
    repeats_unmarked: int = 0
    nodes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every task ended, one at a time, in order; repeats only marked ones at a failover."""
        return not (self.missing or self.overlaps or self.out_of_order or self.repeats_unmarked)


def check_order(
    lines: Iterable[Mapping[str, Any]], *, expected: int, killed: Iterable[str] = ()
) -> OrderVerdict:
    """Check a journal of one ordered queue (see :class:`OrderVerdict`).

    Args:
        lines: the journal, in file order.
        expected: how many tasks were published, numbered from 0.
        killed: nodes that were killed: a run of theirs that never ended is not an overlap when
            the next node starts (the broker gave its task to the next consumer).
    """
    verdict = OrderVerdict(expected=expected)
    dead = set(killed)
    running: tuple[str, int] | None = None  # the run under way: node and seq
    started: set[int] = set()
    ended: set[int] = set()
    due = 0  # the next sequence number in order
    for line in lines:
        seq, node = int(line["seq"]), str(line["node"])
        if line["phase"] == "end":
            ended.add(seq)
            if running == (node, seq):
                running = None
            continue
        previous = verdict.nodes[-1] if verdict.nodes else None
        if previous != node:
            verdict.nodes.append(node)
        if running is not None and not (running[0] in dead and running[0] != node):
            verdict.overlaps += 1
        if seq in started:
            # Allowed once per failover: the task last started, again first, marked redelivered:
            # on the next node, or on the same one when its ack was lost in a broker restart.
            if line.get("redelivered") and seq == due - 1:
                verdict.repeats_marked += 1
            else:
                verdict.repeats_unmarked += 1
        elif seq == due:
            due += 1
        else:
            verdict.out_of_order += 1
            due = max(due, seq + 1)
        started.add(seq)
        running = (node, seq)
    verdict.done = len(ended)
    verdict.missing = [seq for seq in range(expected) if seq not in ended]
    return verdict
