"""A producer process with a spool, for tests that SIGKILL it: ``python -m tests.support.spool_producer``.

It sends ``--count`` tasks through an App with ``spool_dir``, journaling each id before the call
(``confirmed: false``) and after it returned (``confirmed: true``: accepted by the spool) in the
reliability journal's format, then prints a line when a condition holds and waits to be killed:

- ``accepted``: every call returned;
- ``written``: and the spool wrote every one of them (nothing left in its memory buffer);
- ``published``: and the broker confirmed at least ``--published`` of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid

from broker_svc import App, Settings


def _journal(path: str | None, task_id: str, *, accepted: bool) -> None:
    if path is None:
        return
    line = (json.dumps({"id": task_id, "confirmed": accepted}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write per line: a kill never leaves half a line that parses
    finally:
        os.close(fd)


def _until(condition: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit("condition not reached")
        threading.Event().wait(0.02)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--spool-dir", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--task", default="journal.noop")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--flush-count", type=int, default=256)
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--batch", action="store_true", help="send all of them in one app.batch()")
    parser.add_argument("--record", help="the journal's published.jsonl")
    parser.add_argument("--then", choices=["accepted", "written", "published"], default="accepted")
    parser.add_argument("--published", type=int, default=0)
    args = parser.parse_args()
    settings = Settings(
        broker_url=args.url,
        spool_dir=args.spool_dir,
        spool_flush_count=args.flush_count,
        spool_memory_records=max(10_000, args.flush_count),
        spool_fsync=not args.no_fsync,
    )
    app = App("spool-producer", settings=settings)
    ids = [str(uuid.uuid4()) for _ in range(args.count)]
    if args.batch:
        for task_id in ids:
            _journal(args.record, task_id, accepted=False)
        with app.batch():
            for task_id in ids:
                app.send_task(args.task, queue=args.queue, task_id=task_id, ignore_result=True)
        for task_id in ids:
            _journal(args.record, task_id, accepted=True)
    else:
        for task_id in ids:
            _journal(args.record, task_id, accepted=False)
            app.send_task(args.task, queue=args.queue, task_id=task_id, ignore_result=True)
            _journal(args.record, task_id, accepted=True)
    stats = app.spool_stats
    if args.then in ("written", "published"):
        _until(lambda: (s := stats()) is not None and s.buffered == 0)
    if args.then == "published":
        _until(lambda: (s := stats()) is not None and s.published >= args.published)
    print(args.then, flush=True)
    threading.Event().wait(600)  # until the test kills it
    sys.exit(1)


if __name__ == "__main__":
    main()
