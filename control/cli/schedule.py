"""``ctl schedule list|add|remove|pause|resume|run-now``: the periodic schedule, changed at runtime.

Changes are written to the scheduler's journal on the broker (``broker_svc/schedules/client.py``):
durable, and applied by whichever ``clockwork-beat`` or ``worker -B`` leads, within a second. Its
arguments are in ``control/cli/parser.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any, TextIO

from broker_svc.schedules import Crontab, Every
from broker_svc.schedules.client import ScheduleClient, ScheduledEntry
from broker_svc.schedules.journal_record import TermOpened
from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_FAILURE, EX_OK

__all__ = ["describe_leader", "describe_schedule", "format_entries", "schedule_command"]


def schedule_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """Run ``ctl schedule OP``; exit 1 when the entry named does not exist.

    Raises:
        BrokerUnavailable: the journal could not be read or written.
        ValueError: an invalid entry (bad JSON, a bad crontab field).
    """
    del dest
    schedules = ScheduleClient(client.settings, args.scheduler)
    if args.op == "list":
        state = schedules.state()
        entries = schedules.list(state=state)
        if args.json:
            out.write(json.dumps([entry.as_dict() for entry in entries], indent=2, default=str) + "\n")
        else:
            out.write(describe_leader(args.scheduler, schedules.leader(state=state)))
            out.write(format_entries(entries))
        return EX_OK
    if args.op == "add":
        entry = schedules.add(
            args.name, args.task, _schedule(args), args=_json(args.args, list, "--args"),
            kwargs=_json(args.kwargs, dict, "--kwargs"), options={"queue": args.queue} if args.queue else {},
            catch_up=args.catch_up, overlap=args.overlap, paused=args.paused,
        )  # fmt: skip
        out.write(f"added {entry.name}: {entry.task} {describe_schedule(entry.schedule)}\n")
        return EX_OK
    action = {"remove": schedules.remove, "pause": schedules.pause, "resume": schedules.resume}
    try:
        if args.op == "run-now":
            schedules.run_now(args.name)
        else:
            action[args.op](args.name)
    except KeyError as exc:
        err.write(f"ctl: {exc.args[0]}\n")
        return EX_FAILURE
    out.write(f"{args.op} {args.name}: written to the journal of scheduler {args.scheduler!r}\n")
    return EX_OK


def describe_leader(scheduler: str, term: TermOpened | None) -> str:
    """The line above the entries: which scheduler instance leads, in which term, since when."""
    if term is None:
        return f"scheduler {scheduler!r}: no instance has led yet\n"
    who = term.leader or "an instance of an older version"
    since = f", since {_when(term.at)} UTC" if term.at else ""
    return f"scheduler {scheduler!r}: led by {who} (term {term.epoch}{since})\n"


def format_entries(entries: list[ScheduledEntry]) -> str:
    """The entries as an aligned table (name, task, schedule, state, next and last fire)."""
    if not entries:
        return "no entries (none configured, or no scheduler has led yet)\n"
    rows = [("NAME", "TASK", "SCHEDULE", "STATE", "NEXT (UTC)", "LAST (UTC)")]
    for item in entries:
        state = "paused" if item.entry.paused else ("running" if item.running else "active")
        state += " (added)" if item.source == "added" else ""
        schedule = describe_schedule(item.entry.schedule)
        rows.append(
            (item.entry.name, item.entry.task, schedule, state, _when(item.next_fire), _when(item.last_fired))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows
    )


def describe_schedule(schedule: Every | Crontab) -> str:
    """``every 5s`` or ``cron 0 */2 * * mon-fri Europe/Berlin`` (Celery's field order is m h dom mon dow)."""
    if isinstance(schedule, Every):
        return f"every {schedule.seconds:g}s"
    spec = schedule.to_json()
    fields = [spec[name] for name in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")]
    text = " ".join(",".join(map(str, f)) if isinstance(f, list) else str(f) for f in fields)
    return f"cron {text}" + (f" {schedule.timezone}" if schedule.timezone else "")


def _schedule(args: argparse.Namespace) -> Every | Crontab:
    if args.every is not None:
        return Every(args.every)
    fields = args.cron.split()
    if len(fields) != 5:
        raise ValueError(f"--cron needs five fields 'M H DOM MON DOW', got {args.cron!r}")
    minute, hour, day_of_month, month_of_year, day_of_week = fields
    return Crontab(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year,
        day_of_week=day_of_week, timezone=args.timezone,
    )  # fmt: skip


def _json(text: str, kind: type, option: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{option} is not JSON: {exc}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{option} must be a JSON {'list' if kind is list else 'object'}")
    return value


def _when(at: float | None) -> str:
    return "-" if at is None else dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
