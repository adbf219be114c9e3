"""A candidate process for the leader tests: stands for a role and journals its terms.

``python -m tests.reliability.leader_candidate URL ROLE JOURNAL_FILE [--lease-s 2] [--heartbeat-s 1]``.
Its ``execute`` acts (a journal line) about 20 times a second while its guard allows; SIGTERM asks
for a graceful step-down and exit.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from broker_svc.settings import Settings
from tests.reliability.leader_journal import record
from worker.leader import Election, Term


class JournaledHooks:
    """Hooks that journal the term's start, each action, and its stop."""

    def __init__(self, journal: Path) -> None:
        self.journal = journal

    def inaugurate(self, term: Term) -> None:
        at = time.time()
        term.guard()
        record(self.journal, "start", epoch=term.epoch, at=at, previous_handed_over=term.previous_handed_over)

    def execute(self, term: Term) -> None:
        while True:
            at = time.time()  # the action's moment, taken before the guard that allows it
            if not term.still_leader():
                return
            record(self.journal, "act", epoch=term.epoch, at=at)
            if not term.wait(0.05):
                return

    def hand_over(self, term: Term) -> Any:
        graceful = term.still_leader()
        at = time.time() if graceful else term.ended_at
        record(self.journal, "stop", epoch=term.epoch, at=at, graceful=graceful)
        return {"epoch": term.epoch}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("role")
    parser.add_argument("journal", type=Path)
    parser.add_argument("--lease-s", type=float, default=2.0)
    parser.add_argument("--heartbeat-s", type=int, default=1)
    args = parser.parse_args()
    settings = Settings.from_url(args.url, heartbeat_s=args.heartbeat_s, connect_timeout_s=3.0)
    election = Election(settings, name=args.role, hooks=JournaledHooks(args.journal), lease_s=args.lease_s)
    signal.signal(signal.SIGTERM, lambda *_: election.request_stop())
    election.run()


if __name__ == "__main__":
    main()
