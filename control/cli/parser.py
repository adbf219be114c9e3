"""``ctl``'s command line: every command, its arguments and the options common to all.

Only the parser: it imports nothing a command needs to run (pika, structlog, the schedule, the
canvas), so ``ctl --help`` and a mistyped command stay cheap, and ``control/cli/main.py`` loads the
chosen command's module once the arguments are read.
"""

from __future__ import annotations

import argparse
from typing import Any, Final

from broker_svc.version import add_version_option
from control.protocol.commands import COMMANDS, CommandKind

__all__ = ["CONTROL_METHODS", "INSPECT_METHODS", "build_parser"]


# CLI name -> (wire method, help)
INSPECT_METHODS: Final = {
    "ping": ("ping", "ping the workers"),
    "active": ("active", "tasks running now"),
    "reserved": ("reserved", "tasks received, not started"),
    "scheduled": ("scheduled", "tasks waiting for their ETA"),
    "revoked": ("revoked", "revoked task ids"),
    "registered": ("registered", "task names each worker knows (with ATTRs: name [attr=value ...])"),
    "stats": ("stats", "worker statistics"),
    "clock": ("clock", "each worker's Lamport clock"),
    "query-task": ("query_task", "where tasks are (active, reserved)"),
    "active-queues": ("active_queues", "queues each worker consumes"),
    "conf": ("conf", "worker configuration"),
    "report": ("report", "each worker's report: software versions, platform, settings"),
    "dedup": ("dedup", "dedup gate: shards kept, keys held, decisions counted"),
}

# ``ctl control <method> ARG...``: every control command but those with a command of their own.
CONTROL_HELP: Final = {
    "time_limit": "set a task's time limits: TASK SOFT HARD (seconds; none for no limit)",
    "rate_limit": "set a task's rate limit: TASK RATE (e.g. 10/s, 100/m; 0 turns it off)",
    "pool_grow": "add N pool children (default 1)",
    "pool_shrink": "remove N pool children (default 1)",
    "autoscale": "set the autoscaler's bounds: MAX MIN",
    "add_consumer": "start consuming QUEUE",
    "cancel_consumer": "stop consuming QUEUE (tasks already taken still run)",
    "enable_events": "start sending task events (what Flower and ctl events show)",
    "disable_events": "stop sending task events",
    "heartbeat": "send a worker-heartbeat event now",
}
CONTROL_METHODS: Final = {
    name: command
    for name, command in COMMANDS.items()
    if command.kind is CommandKind.CONTROL and name not in ("revoke", "terminate", "shutdown")
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; common options go before or after any subcommand."""
    parser = argparse.ArgumentParser(
        prog="ctl", description="Inspect and control Clockwork (and Celery) workers."
    )
    _add_common(parser, default=True)
    add_version_option(parser)
    # Repeated on every sub-parser with SUPPRESS defaults, so a later position only overrides
    # what it actually sets.
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, default=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser("inspect", parents=[common], help="ask workers (read-only)")
    methods = inspect.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name, (_, text) in INSPECT_METHODS.items():
        method = methods.add_parser(name, parents=[common], help=text, description=text)
        if name == "query-task":
            method.add_argument("ids", nargs="+", metavar="ID", help="task ids")
        elif name == "active":
            method.add_argument("--safe", action="store_true", help="args and kwargs as repr strings")
        elif name == "conf":
            method.add_argument("--with-defaults", action="store_true", help="include default values")
        elif name == "registered":
            method.add_argument("taskinfoitems", nargs="*", metavar="ATTR", help="task attributes to show")

    control = commands.add_parser("control", parents=[common], help="change workers (rate limits, pool, ...)")
    changes = control.add_subparsers(dest="method", required=True, metavar="METHOD")
    for name, command in CONTROL_METHODS.items():
        text = CONTROL_HELP.get(name, name.replace("_", " "))
        change = changes.add_parser(
            name.replace("_", "-"), parents=[common], help=text, description=f"{text}. Reply: {command.reply}"
        )
        order = ", ".join(command.params) or "none"
        change.add_argument("values", nargs="*", metavar="ARG", help=f"arguments in order: {order}")

    revoke = commands.add_parser("revoke", parents=[common], help="revoke tasks (durably)")
    revoke.add_argument("ids", nargs="+", metavar="ID", help="task ids")
    revoke.add_argument("--terminate", action="store_true", help="also kill the tasks if running")
    revoke.add_argument("--signal", default="SIGTERM", help="signal for --terminate (default SIGTERM)")
    task = commands.add_parser(
        "task", parents=[common], help="a task's history from the task-state stream (task_states)"
    )
    task.add_argument("ids", nargs="+", metavar="ID", help="task ids")
    queues = commands.add_parser(
        "queues",
        parents=[common],
        help="queue depths: ready, held by workers, consumers, dead letters, rate",
        description="Each queue's ready messages, the tasks workers hold from it (running or prefetched), "
        "its consumers, its dead letters (<queue>.dead) and how fast it grows or drains. Without "
        "names: the queues the live workers consume.",
    )
    queues.add_argument("names", nargs="*", metavar="QUEUE", help="queues to show (default: the workers')")
    queues.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="seconds between the two samples of the rate"
    )
    top = commands.add_parser(
        "top",
        parents=[common],
        help="a live view: workers, their running tasks, queue depths and rates",
        description="Refreshed in place every --interval seconds until Ctrl-C (or --iterations).",
    )
    top.add_argument("--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes")
    top.add_argument("--iterations", type=int, default=None, metavar="N", help="stop after N refreshes")
    commands.add_parser("status", parents=[common], help="list the workers that answer")
    commands.add_parser("shutdown", parents=[common], help="ask workers to shut down (warm)")
    events = commands.add_parser("events", parents=[common], help="follow live events")
    events.add_argument("--count", type=int, default=None, metavar="N", help="stop after N events")
    events.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    events.add_argument(
        "--type",
        action="append",
        default=None,
        metavar="TYPE[,TYPE]",
        help="show only these event types; one ending in - or * is a prefix (task- for every task event)",
    )
    _add_schedule(commands, common)
    _add_dead(commands, common)
    return parser


def _add_common(parser: argparse.ArgumentParser, *, default: bool) -> None:
    def value(real: Any) -> Any:
        return real if default else argparse.SUPPRESS

    parser.add_argument(
        "-b",
        "--broker",
        default=value(None),
        help="AMQP URL (default: $CLOCKWORK_BROKER_URL, else local guest)",
    )
    parser.add_argument(
        "-d",
        "--destination",
        action="append",
        default=value(None),
        metavar="NODE[,NODE]",
        help="address only these nodes (comma-separated or repeated)",
    )
    parser.add_argument(
        "--timeout", type=float, default=value(1.0), help="seconds to wait at most (default 1.0)"
    )
    parser.add_argument("--json", action="store_true", default=value(False), help="print JSON")
    parser.add_argument(
        "--app-namespace",
        default=value(None),
        metavar="NS",
        help="the app whose revokes, schedules and job states to use: its app_namespace, else its "
        "name (default: $CLOCKWORK_APP_NAMESPACE, else celery)",
    )


def _add_schedule(commands: Any, common: argparse.ArgumentParser) -> None:
    # ``ctl schedule`` and its operations.
    # On ``schedule`` and on each operation: a default only on the first, so ``--scheduler`` may
    # come before or after the operation.
    # (Two parsers: a parent's actions are shared by reference, defaults included.)
    which, which_first = argparse.ArgumentParser(add_help=False), argparse.ArgumentParser(add_help=False)
    for parser, default in ((which, argparse.SUPPRESS), (which_first, "default")):
        parser.add_argument(
            "--scheduler",
            default=default,
            metavar="NAME",
            help="the scheduler (--scheduler-name), default: default",
        )
    schedule = commands.add_parser(
        "schedule",
        parents=[common, which_first],
        help="list and change the periodic schedule (clockwork-beat, worker -B)",
        description="The entries of a scheduler, and changes to them that last: written to its journal on "
        "the broker, applied by whichever scheduler instance leads.",
    )
    ops = schedule.add_subparsers(dest="op", required=True, metavar="OP")
    ops.add_parser("list", parents=[common, which], help="the entries in force, their next and last fires")
    add = ops.add_parser("add", parents=[common, which], help="add an entry (or replace the one of its name)")
    add.add_argument("name", help="the entry's name")
    add.add_argument("task", help="the task's name")
    when = add.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--every", type=float, metavar="SECONDS", help="fire every SECONDS (anchored at the epoch)"
    )
    when.add_argument(
        "--cron", metavar="'M H DOM MON DOW'", help="fire at a crontab's times (Celery's fields)"
    )
    add.add_argument("--timezone", default=None, help="the crontab's zone, e.g. Europe/Berlin (default UTC)")
    add.add_argument("--args", default="[]", metavar="JSON", help="positional arguments, a JSON list")
    add.add_argument("--kwargs", default="{}", metavar="JSON", help="keyword arguments, a JSON object")
    add.add_argument("--queue", default=None, help="the queue to send to (default: the task's route)")
    add.add_argument(
        "--catch-up", choices=("skip", "once", "all"), default="once", help="missed times (once)"
    )
    add.add_argument("--overlap", choices=("allow", "skip"), default="allow", help="while a run runs (allow)")
    add.add_argument("--paused", action="store_true", help="add it paused")
    for op, text in (
        ("remove", "remove an entry (a configured one stays removed until added again)"),
        ("pause", "stop firing an entry until resumed"),
        ("resume", "fire a paused entry again"),
        ("run-now", "fire an entry once now, besides its schedule"),
    ):
        ops.add_parser(op, parents=[common, which], help=text).add_argument("name", help="the entry's name")


def _add_dead(commands: Any, common: argparse.ArgumentParser) -> None:
    # ``ctl dead`` and its operations (control/cli/dead.py).
    dead = commands.add_parser(
        "dead",
        parents=[common],
        help="list, show, requeue and purge dead letters (<queue>.dead)",
        description="The tasks workers kept in <queue>.dead: never run, or failed for good (see the "
        "guide, 'Handling dead letters'). QUEUE is a task queue or its dead queue; without one, the "
        "dead queues of the queues the live workers consume, the default queue and the expired queue. "
        "--timeout bounds the wait for the workers' answer and for another ctl done with a dead queue.",
    )
    ops = dead.add_subparsers(dest="op", required=True, metavar="OP")
    listing = ops.add_parser("list", parents=[common], help="task, id, reason, when and queue of each")
    listing.add_argument("queue", nargs="?", metavar="QUEUE", help="only this queue's dead letters")
    listing.add_argument("--limit", type=int, default=None, metavar="N", help="show the first N only")
    show = ops.add_parser("show", parents=[common], help="one dead letter: headers, properties, body")
    show.add_argument("id", metavar="ID", help="the task id")
    show.add_argument("--queue", default=None, metavar="QUEUE", help="look only in this queue's dead letters")
    requeue = ops.add_parser(
        "requeue",
        parents=[common],
        help="send dead letters back to their queue (delivery count reset), each once",
        description="Each copy is confirmed by the broker before its dead letter is acked; a requeue "
        "cut short is finished by the next ctl dead command, without sending a task twice.",
    )
    requeue.add_argument("ids", nargs="*", metavar="ID", help="task ids")
    requeue.add_argument("--all", action="store_true", help="every dead letter (of --queue, else of all)")
    requeue.add_argument("--queue", default=None, metavar="QUEUE", help="only this queue's dead letters")
    requeue.add_argument(
        "--to", default=None, metavar="QUEUE", help="send them to QUEUE instead of the queue they came from"
    )
    purge = ops.add_parser("purge", parents=[common], help="delete dead letters for good (needs --yes)")
    purge.add_argument("queue", nargs="?", metavar="QUEUE", help="only this queue's dead letters")
    purge.add_argument("--yes", action="store_true", help="yes, delete them")
