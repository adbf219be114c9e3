"""The leader fault cycles: kill, freeze, forced disconnect, SIGTERM (and, on the cluster, partition).

Each cycle finds the leader in the journal, breaks it, measures until the next term starts, and
puts the candidate count back. The journal checker judges the whole run afterwards.
"""

from __future__ import annotations

import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.reliability.leader_journal import Interval
from tests.support.leaders import Candidates

__all__ = ["Cycles", "summary"]


@dataclass
class Cycles:
    """Runs fault cycles on ``candidates``; ``disconnect(name)`` closes a candidate's connection
    from the broker's side, ``partition(name)``/``heal()`` cut its broker node off (cluster only)."""

    candidates: Candidates
    disconnect: Callable[[str], None]
    partition: Callable[[str], None] | None = None
    heal: Callable[[], None] | None = None
    failover_s: dict[str, list[float]] = field(default_factory=dict)

    def run(self, fault: str) -> None:
        c = self.candidates
        leader: Interval = c.current()
        name = leader.holder
        timeout = c.lease_s * 2 + c.heartbeat_s * 4 + 20
        if fault == "kill":
            at = c.signal(name, signal.SIGKILL)
            new = c.wait_new_term(at, timeout_s=timeout, message="a new leader after SIGKILL")
            c.processes[name].wait(timeout=10)
            c.spawn()
        elif fault == "freeze":
            at = c.signal(name, signal.SIGSTOP)
            new = c.wait_new_term(at, timeout_s=timeout, message="a new leader after SIGSTOP")
            c.signal(name, signal.SIGCONT)
            # Resumed, it finds its lease gone and journals the term's end (at the lease's end).
            ended = c.wait_stop(name, leader.epoch, timeout_s=timeout)
            assert ended.extra["graceful"] is False and ended.end <= new.start
        elif fault == "disconnect":
            at = time.time()
            self.disconnect(name)
            new = c.wait_new_term(at, timeout_s=timeout, message="a new leader after a forced disconnect")
            ended = c.wait_stop(name, leader.epoch, timeout_s=timeout)
            assert ended.end <= new.start
        elif fault == "partition":
            assert self.partition is not None and self.heal is not None
            at = time.time()
            self.partition(name)
            new = c.wait_new_term(at, timeout_s=timeout + 30, message="a new leader after a partition")
            ended = c.wait_stop(name, leader.epoch, timeout_s=timeout)
            assert ended.end <= new.start
            self.heal()
        elif fault == "term":
            at = c.signal(name, signal.SIGTERM)
            new = c.wait_new_term(at, timeout_s=timeout, message="a new leader after SIGTERM")
            assert c.processes[name].wait(timeout=10) == 0
            c.spawn()
        else:
            raise ValueError(fault)
        self.failover_s.setdefault(fault, []).append(new.start - at)


def summary(failover_s: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """p50 and max seconds to the next term, per fault."""
    return {
        fault: {"n": len(v), "p50_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
        for fault, v in failover_s.items()
    }
