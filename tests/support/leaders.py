"""Leader-election candidate processes for tests, and their journal (tests/reliability/leader_journal.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.reliability.leader_journal import Interval, read_intervals
from tests.support.waiting import wait_for

__all__ = ["Candidates"]


@dataclass
class Candidates:
    """Candidate processes of one role, each journaling to ``<directory>/c<n>.jsonl``."""

    url: str
    role: str
    directory: Path
    lease_s: float = 2.0
    heartbeat_s: int = 1
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _next: int = 0

    def spawn(self, count: int = 1) -> list[str]:
        """Start ``count`` more candidates; their names."""
        names = []
        for _ in range(count):
            name = f"c{self._next}"
            self._next += 1
            command = [
                sys.executable, "-m", "tests.reliability.leader_candidate", self.url, self.role,
                str(self.directory / f"{name}.jsonl"), "--lease-s", str(self.lease_s),
                "--heartbeat-s", str(self.heartbeat_s),
            ]  # fmt: skip
            self.processes[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL)
            names.append(name)
        return names

    def intervals(self) -> list[Interval]:
        return read_intervals(self.directory)

    def current(self) -> Interval:
        """The current leader's term; fails the test if none comes within 30 s."""
        found = wait_for(self.leader, timeout_s=30, message="a leader")
        assert found is not None
        return found

    def leader(self) -> Interval | None:
        """The latest term with no stop whose process lives, if any."""
        open_terms = [
            i for i in self.intervals()
            if i.stop is None and self.processes[i.holder].poll() is None
        ]  # fmt: skip
        return max(open_terms, key=lambda i: i.start, default=None)

    def wait_new_term(self, after: float, *, timeout_s: float, message: str) -> Interval:
        """Wait for a term that started after ``after`` (wall clock); it."""

        def started() -> Interval | None:
            late = [i for i in self.intervals() if i.start > after]
            return min(late, key=lambda i: i.start, default=None)

        found = wait_for(started, timeout_s=timeout_s, interval_s=0.02, message=message)
        assert found is not None
        return found

    def wait_stop(self, holder: str, epoch: int, *, timeout_s: float) -> Interval:
        """Wait until ``holder`` journaled the stop of term ``epoch``."""

        def stopped() -> Interval | None:
            return next(
                (i for i in self.intervals() if i.holder == holder and i.epoch == epoch and i.stop), None
            )

        found = wait_for(stopped, timeout_s=timeout_s, message=f"{holder} journaled the end of term {epoch}")
        assert found is not None
        return found

    def signal(self, name: str, signum: int) -> float:
        """Send ``signum`` to candidate ``name``; the wall-clock time it was sent."""
        at = time.time()
        os.kill(self.processes[name].pid, signum)
        return at

    def close(self) -> None:
        """Kill every candidate still running (after a test) and reap them."""
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait(timeout=10)
