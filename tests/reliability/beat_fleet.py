"""``clockwork-beat`` processes of one scheduler for the fault tests: find the leader, break it.

The leader is read from the processes' logs: the live, unfrozen process whose latest
``beat_leading`` has no ``beat_stepped_down`` after it, highest epoch first. A fault is a SIGKILL
(the process is replaced) or a SIGSTOP (the process is resumed once the next leader fired, finds
its term gone and stands again), so the fleet keeps its size. Each fault's failover gap runs from
the signal to the next leader's first ``beat_fired`` (its log line's timestamp).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.beat_check import Fired
from tests.support.beats import BeatProcess
from tests.support.waiting import wait_for

__all__ = ["Fleet", "stamp"]


def stamp(event: dict[str, Any]) -> float:
    """The wall-clock time of a log line (``timestamp``, ISO 8601 UTC)."""
    return dt.datetime.fromisoformat(event["timestamp"]).timestamp()


def _open_term(events: list[dict[str, Any]]) -> int | None:
    """The epoch of the term this process's log says it leads now, if any."""
    epoch = None
    for event in events:
        if event.get("event") == "beat_leading":
            epoch = int(event["epoch"])
        elif event.get("event") == "beat_stepped_down" and event.get("epoch") == epoch:
            epoch = None
    return epoch


@dataclass
class Fleet:
    """``size`` ``clockwork-beat`` processes of ``scheduler``, kept at that size through faults."""

    url: str
    scheduler: str
    env: dict[str, str]
    lease_s: float
    heartbeat_s: float
    size: int = 3
    processes: list[BeatProcess] = field(default_factory=list)  # every one started, dead ones too
    failover_s: dict[str, list[float]] = field(default_factory=dict)
    _frozen: set[int] = field(default_factory=set)

    def spawn(self, count: int = 1) -> None:
        for _ in range(count):
            self.processes.append(
                BeatProcess(self.url, scheduler=self.scheduler, env=self.env, lease_s=self.lease_s)
            )

    def _standing(self) -> list[BeatProcess]:
        return [p for p in self.processes if p.proc.poll() is None and p.proc.pid not in self._frozen]

    def leader(self) -> tuple[BeatProcess, int] | None:
        """The standing process that leads, and its epoch (None between terms)."""
        terms = [(epoch, p) for p in self._standing() if (epoch := _open_term(p.events())) is not None]
        if not terms:
            return None
        epoch, process = max(terms, key=lambda term: term[0])
        return process, epoch

    def current(self, timeout_s: float = 30.0) -> tuple[BeatProcess, int]:
        found = wait_for(self.leader, timeout_s=timeout_s, interval_s=0.1, message="a scheduler leads")
        assert found is not None
        return found

    def first_fire_after(self, epoch: int) -> float | None:
        """When a term later than ``epoch`` first fired (its first ``beat_fired``), if one did."""
        times = []
        for process in self.processes:
            in_later_term = False
            for event in process.events():
                if event.get("event") == "beat_leading":
                    in_later_term = int(event["epoch"]) > epoch
                elif in_later_term and event.get("event") == "beat_fired":
                    times.append(stamp(event))
                    break
        return min(times, default=None)

    def fault(self, kind: str) -> float:
        """Break the leader (``kill``: SIGKILL; ``freeze``: SIGSTOP, SIGCONT after the failover),
        wait for the next leader's first fire, put the fleet back to its size; the gap in seconds."""
        process, epoch = self.current()
        pid = process.proc.pid
        # The broker notices a frozen leader after two missed heartbeats, the next one waits the lease.
        timeout_s = 2 * self.heartbeat_s + 2 * self.lease_s + 30
        at = time.time()
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "freeze":
            os.kill(pid, signal.SIGSTOP)
            self._frozen.add(pid)
        else:
            raise ValueError(f"unknown fault {kind!r}")
        fired = wait_for(
            lambda: self.first_fire_after(epoch), timeout_s=timeout_s, interval_s=0.1,
            message=f"a new leader fired after the {kind} of the leader of term {epoch}",
        )  # fmt: skip
        assert fired is not None
        if kind == "kill":
            process.proc.wait(timeout=10)
            self.spawn()
        else:
            os.kill(pid, signal.SIGCONT)
            self._frozen.discard(pid)
            # Resumed, it finds its lease gone, steps down and stands again.
            wait_for(
                lambda: _open_term(process.events()) != epoch, timeout_s=timeout_s, interval_s=0.1,
                message=f"the resumed leader of term {epoch} stepped down",
            )  # fmt: skip
        gap = fired - at
        self.failover_s.setdefault(kind, []).append(gap)
        return gap

    def events(self, name: str) -> list[dict[str, Any]]:
        """Every process's log events named ``name``."""
        return [e for p in self.processes for e in p.events() if e.get("event") == name]

    def fires(self) -> list[Fired]:
        """Every ``beat_fired`` with the start of the term it was fired in."""
        found = []
        for process in self.processes:
            term_started = 0.0
            for event in process.events():
                if event.get("event") == "beat_leading":
                    term_started = stamp(event)
                elif event.get("event") == "beat_fired":
                    found.append(Fired(float(event["scheduled"]), float(event["late_s"]), term_started))
        return found

    def stop(self, timeout_s: float = 30.0) -> None:
        """Resume any frozen process, SIGTERM them all (the leader hands over) and wait; logs stay."""
        for pid in self._frozen:
            os.kill(pid, signal.SIGCONT)
        self._frozen.clear()
        for process in self.processes:
            if process.proc.poll() is None:
                process.proc.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop every process and remove the logs."""
        self.stop()
        for process in self.processes:
            process.close()
