"""``ctl task ID``: a task's history from the task-state stream (state, time, writer), or ``--json``."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import TextIO

from broker_svc.connection.state_feed import StateFeed
from broker_svc.results.jobs import latest_state
from broker_svc.wire.records.task_state import StateRecord
from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_FAILURE, EX_OK

__all__ = ["format_history", "task_command"]


def task_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """Print each id's records in order; exit 1 if one of them has none (UNKNOWN).

    Raises:
        BrokerUnavailable: the stream could not be read within ``--timeout``.
    """
    del dest
    feed = StateFeed(client.settings)
    try:
        histories = {task_id: feed.history(task_id, timeout=args.timeout) for task_id in args.ids}
    finally:
        feed.close()
    if args.json:
        shown = {
            task_id: {"state": latest_state(records), "history": [r.as_dict() for r in records]}
            for task_id, records in histories.items()
        }
        out.write(json.dumps(shown, indent=2, default=str) + "\n")
    else:
        for task_id, records in histories.items():
            out.write(format_history(task_id, records))
    unknown = [task_id for task_id, records in histories.items() if not records]
    if unknown:
        err.write(f"ctl: no record of {', '.join(unknown)} within the stream's retention (UNKNOWN)\n")
        return EX_FAILURE
    return EX_OK


def format_history(task_id: str, records: list[StateRecord]) -> str:
    """A task's history as lines: its latest state, then one row per record."""
    lines = [f"{task_id}: {latest_state(records)}"]
    for record in records:
        when = dt.datetime.fromtimestamp(record.at, dt.UTC).isoformat(timespec="milliseconds")
        detail = " ".join(f"{key}={value}" for key, value in record.info.items())
        where = f" queue={record.queue}" if record.queue else ""
        lines.append(
            f"  {when}  {record.state:<8} {record.hostname}{where} clock={record.clock} {detail}".rstrip()
        )
    return "\n".join(lines) + "\n"
