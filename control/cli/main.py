"""``ctl``: inspect and control workers from a shell (``ctl inspect ping``, ``ctl revoke ID``, ...).

Exit status: 0 when every addressed worker answered (the destination list, else the live members;
when membership is unknown, when anyone answered), 69 when none did (Celery's EX_UNAVAILABLE),
1 when some did not or the broker is unreachable, 2 for usage errors. A revoke that reached the
durable revocation log exits 0 even when no worker answered: workers apply it when they start.

With ``$CLOCKWORK_CONTROL_KEY`` set, requests are signed and unsigned replies dropped (see the
guide, "Securing the control plane"); requests carry the URL's user as ``user_id``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TextIO

from broker_svc.errors import BrokerUnavailable, ConfigurationError
from broker_svc.logging import configure_logging
from broker_svc.settings import Settings
from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_FAILURE, EX_OK, EX_UNAVAILABLE
from control.cli.render import (
    Style,
    format_event,
    format_nodes,
    is_error,
    is_ok,
    show,
    summarize,
)
from control.cli.schedule import add_schedule_parser, schedule_command
from control.cli.task_history import task_command
from control.cli.watch import queues_command, top_command
from control.protocol.commands import COMMANDS, CommandKind, Param
from control.protocol.event_order import ReorderBuffer
from control.protocol.replies import BroadcastResult
from control.protocol.request import flatten_replies

__all__ = ["EX_UNAVAILABLE", "build_parser", "main"]


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

_REORDER_WINDOW_S: Final = 0.5


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; common options go before or after any subcommand."""
    parser = argparse.ArgumentParser(
        prog="ctl", description="Inspect and control Clockwork (and Celery) workers."
    )
    _add_common(parser, default=True)
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
    add_schedule_parser(commands, common)
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


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of ``ctl``; returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("warning")
    logging.getLogger("pika").setLevel(logging.CRITICAL)  # connection failures get our one line
    try:
        settings = Settings.from_env()
        if args.broker:
            settings = settings.with_options(broker_url=args.broker)
        if args.app_namespace:
            settings = settings.with_options(app_namespace=args.app_namespace)
    except ConfigurationError as exc:
        parser.error(str(exc))
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    destination = [n.strip() for item in args.destination or () for n in item.split(",") if n.strip()] or None
    run = _COMMANDS[args.command]
    try:
        with ControlClient(settings) as client:
            return run(client, args, destination, out, err)
    except BrokerUnavailable as exc:
        err.write(f"ctl: cannot reach the broker: {exc}\n")
        return EX_FAILURE
    except ValueError as exc:  # e.g. a malformed task id
        parser.error(str(exc))


# -- commands --------------------------------------------------------------------------------------

Command = Callable[[ControlClient, argparse.Namespace, list[str] | None, TextIO, TextIO], int]


def _inspect(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    method = INSPECT_METHODS[args.method][0]
    arguments: dict[str, Any] = {}
    if method == "query_task":
        arguments["ids"] = args.ids
    elif method == "active":
        arguments["safe"] = args.safe
    elif method == "conf":
        arguments["with_defaults"] = args.with_defaults
    elif method == "registered":
        arguments["taskinfoitems"] = args.taskinfoitems
    result = client.broadcast(method, arguments, destination=dest, reply=True, timeout_s=args.timeout)
    show(flatten_replies(result.replies), args.json, out, method=method, style=Style.for_stream(out))
    return _status(result, err)


def _control(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    method = args.method.replace("-", "_")
    params = CONTROL_METHODS[method].params
    if len(args.values) > len(params):
        raise ValueError(f"{args.method} takes at most {len(params)} argument(s): {', '.join(params)}")
    arguments = {
        name: _convert(value, params[name]) for name, value in zip(params, args.values, strict=False)
    }
    result = client.broadcast(method, arguments, destination=dest, reply=True, timeout_s=args.timeout)
    show(flatten_replies(result.replies), args.json, out, style=Style.for_stream(out))
    return _status(result, err)


def _convert(value: str, param: Param) -> Any:
    # Positional words to the types the command takes, as Celery's CLI converts them.
    if value.lower() in ("none", "null"):
        return None
    for kind in (bool, int, float):
        if kind in param.types:
            try:
                return value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
            except ValueError:
                continue
    if str in param.types:
        return value
    raise ValueError(f"{value!r} is not a valid {' or '.join(t.__name__ for t in param.types)}")


def _status_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    result = client.broadcast("ping", destination=dest, reply=True, timeout_s=args.timeout)
    by_node = flatten_replies(result.replies)
    if args.json:
        out.write(json.dumps(by_node, default=str) + "\n")
    else:
        style = Style.for_stream(out)
        for node, value in by_node.items():
            out.write(f"{style.node(node)}: {style.ok('OK') if is_ok(value) else summarize(value)}\n")
        if by_node:
            out.write(f"\n{len(by_node)} node{'s' if len(by_node) != 1 else ''} online.\n")
    return _status(result, err)


def _revoke(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    result = client.revoke(
        args.ids,
        terminate=args.terminate,
        signal=args.signal,
        reply=True,
        destination=dest,
        timeout_s=args.timeout,
    )
    show(flatten_replies(result.replies), args.json, out)
    if not result.logged:
        err.write(
            "ctl: warning: the revoke is NOT in the revocation log; workers that did not answer miss it\n"
        )
        return _status(result, err)
    if not result.replies:
        err.write("revoke logged; no worker answered (workers apply it when they start)\n")
    elif result.missing:
        err.write(
            f"revoke logged; no reply from {format_nodes(result.missing)} (they read it from the log)\n"
        )
    return EX_OK


def _shutdown(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    client.broadcast("shutdown", destination=dest, timeout_s=args.timeout)
    err.write(f"shutdown sent to {', '.join(dest) if dest else 'all nodes'}\n")
    return EX_OK


def _events(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    ordered = ReorderBuffer(_REORDER_WINDOW_S)
    deadline = time.monotonic() + args.duration if args.duration is not None else None
    printed = 0

    def emit(events: list[dict[str, Any]]) -> bool:
        nonlocal printed
        for event in events:
            if dest and event.get("hostname") not in dest:
                continue
            out.write((json.dumps(event, default=str) if args.json else format_event(event)) + "\n")
            out.flush()
            printed += 1
            if args.count is not None and printed >= args.count:
                return True
        return False

    try:
        for tick, batch in enumerate(client.iter_events()):
            if tick == 0:  # the queue is bound by now: say so (scripts wait for this line)
                err.write("ctl: listening for events (Ctrl-C to stop)\n")
                err.flush()
            now = time.monotonic()
            for event in batch:
                ordered.push(event, now)
            if emit(ordered.pop_ready(now)):
                return EX_OK
            if deadline is not None and now >= deadline:
                emit(ordered.drain())
                return EX_OK
    except KeyboardInterrupt:
        emit(ordered.drain())
    return EX_OK


_COMMANDS: Final[dict[str, Command]] = {
    "inspect": _inspect,
    "queues": queues_command,
    "top": top_command,
    "control": _control,
    "status": _status_command,
    "revoke": _revoke,
    "shutdown": _shutdown,
    "events": _events,
    "task": task_command,
    "schedule": schedule_command,
}


# -- exit status -----------------------------------------------------------------------------------


def _status(result: BroadcastResult, err: TextIO) -> int:
    if not result.replies:
        err.write("No nodes replied within time constraint.\n")
        return EX_UNAVAILABLE
    if result.missing:
        err.write(f"ctl: no reply from {format_nodes(result.missing)}\n")
        return EX_FAILURE
    failed = frozenset(node for node, value in flatten_replies(result.replies).items() if is_error(value))
    if failed:
        err.write(f"ctl: the command failed on {format_nodes(failed)}\n")
        return EX_FAILURE
    return EX_OK


if __name__ == "__main__":
    sys.exit(main())
