"""What ``--dedupe-window`` and the counts cost a consuming child per task: ``python -m bench.dedupe``.

No broker: the shared window (``worker/shared/dedupe.py``) and the child's ledger
(``worker/consume/ledger.py``) alone, as a child calls them for each delivery. Figures are
microseconds per task, the best of ``--rounds``:

- ``claim+release``: one claim and its release (finished), an empty table and a full one (every
  bucket evicting its oldest id);
- ``two processes``: the same, in two processes at once on one table (the file lock contended);
- ``ledger``: everything the child does per task for the dedupe and the counts, with and without
  ``--dedupe-window``, minus a bare loop doing the same calls' work without the ledger.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from worker.child.channel import ChildChannel
from worker.consume.ledger import FeedLedger
from worker.ipc import Job
from worker.rules.disposition import Disposition, Fate
from worker.shared.dedupe import SharedDedupe

_FINISHED = Disposition(Fate.ACK, ran=True, finished=True)


def _claims(table: SharedDedupe, prefix: str, count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        claim = table.claim(f"{prefix}-{i}", 0)
        if claim is not None:
            table.release(claim, finished=True)
    return (time.perf_counter() - started) / count * 1e6


def _in_child(path: str, prefix: str, count: int, out: Any) -> None:
    table = SharedDedupe(Path(path), ttl_s=3600, owner=False)
    out.put(_claims(table, prefix, count))
    table.close()


def _ledger_loop(ledger: FeedLedger, prefix: str, count: int) -> float:
    delivery = SimpleNamespace(queue="q")
    run = ledger.timed(lambda job: {"status": "SUCCESS"})
    jobs = [Job(task_id=f"{prefix}-{i}", task_name="t", args=[], kwargs={}, request={}) for i in range(count)]
    started = time.perf_counter()
    for job in jobs:
        request = SimpleNamespace(id=job.task_id, retries=0, task="t")
        with ledger.settling(delivery):  # type: ignore[arg-type]
            if not ledger.duplicate(request, redelivered=False):  # type: ignore[arg-type]
                run(job)
                ledger.decided((_FINISHED, None))
    return (time.perf_counter() - started) / count * 1e6


def _drain(sock: socket.socket) -> None:
    with sock:
        while sock.recv(1 << 16):
            pass


def _best(rounds: int, measure: Callable[[int], float]) -> float:
    return min(measure(i) for i in range(rounds))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=50_000, help="tasks per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    count, rounds = args.tasks, args.rounds

    table = SharedDedupe.create(ttl_s=3600)  # 100,000 ids
    try:
        empty = _best(rounds, lambda r: _claims(table, f"empty{r}", min(count, 100_000 // (rounds + 1))))
        for fill in range(3):  # a window longer than the table holds: every bucket full
            _claims(table, f"fill{fill}", 100_000)
        full = _best(rounds, lambda r: _claims(table, f"full{r}", count))
    finally:
        table.close()
    print(f"claim+release, empty table:     {empty:6.2f} µs/task")
    print(f"claim+release, full table:      {full:6.2f} µs/task (each claim evicts the bucket's oldest)")

    context = multiprocessing.get_context("spawn")
    shared = SharedDedupe.create(ttl_s=3600)
    try:
        out = context.SimpleQueue()
        children = [
            context.Process(target=_in_child, args=(str(shared.path), f"p{i}", count, out)) for i in range(2)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join()
        each = sorted([out.get(), out.get()])
    finally:
        shared.close()
    print(f"claim+release, two processes:   {each[0]:6.2f} and {each[1]:6.2f} µs/task (one table, one lock)")

    ours, theirs = socket.socketpair()
    # The worker's end: read and dropped, so the reports never wait for room in the socket.
    threading.Thread(target=_drain, args=(ours,), daemon=True).start()
    try:
        with_window = FeedLedger(dedupe=SharedDedupe.create(ttl_s=3600))
        without = FeedLedger(dedupe=None)
        for ledger in (with_window, without):
            ledger.report_to(ChildChannel(theirs))
        bare = _best(rounds, lambda r: _ledger_loop(FeedLedger(dedupe=None), f"b{r}", count))  # not counting
        windowed = _best(rounds, lambda r: _ledger_loop(with_window, f"w{r}", count))
        counted = _best(rounds, lambda r: _ledger_loop(without, f"c{r}", count))
        for ledger in (with_window, without):
            ledger.close()
    finally:
        theirs.close()
    print(f"ledger, counts only:            {counted - bare:6.2f} µs/task over the calls themselves")
    print(f"ledger, counts and the window:  {windowed - bare:6.2f} µs/task over the calls themselves")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
