"""``ctl inspect``, ``control``, ``status``, ``revoke`` and ``shutdown``: one request over the mailbox,
its replies printed, and the exit status from who answered (see ``control/cli/main.py``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_FAILURE, EX_OK, EX_UNAVAILABLE, EX_USAGE
from control.cli.parser import CONTROL_METHODS, INSPECT_METHODS
from control.cli.render import Style, format_nodes, is_error, is_ok, show, summarize
from control.protocol.commands import Command, Param
from control.protocol.replies import BroadcastResult
from control.protocol.request import flatten_replies

__all__ = ["control_command", "inspect_command", "revoke_command", "shutdown_command", "status_command"]


def inspect_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl inspect METHOD``: ask the workers, print their replies (read-only)."""
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


def control_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl control METHOD ARG...``: change the workers; positional words become the command's arguments.

    Arguments the command's schema refuses (too many, too few, the wrong type) are a usage error,
    exit 2, before anything is sent: a request every worker can only refuse is no request.
    """
    method = args.method.replace("-", "_")
    command = CONTROL_METHODS[method]
    try:
        arguments = _arguments(args.method, command, args.values)
    except ValueError as exc:
        err.write(f"ctl: error: {exc}\n{_usage(args.method, command)}\n")
        return EX_USAGE
    result = client.broadcast(method, arguments, destination=dest, reply=True, timeout_s=args.timeout)
    show(flatten_replies(result.replies), args.json, out, style=Style.for_stream(out))
    return _status(result, err)


def _arguments(cli_name: str, command: Command, values: list[str]) -> dict[str, Any]:
    # The positional words as the command's keyword arguments, checked as the workers check them.
    params = command.params
    if len(values) > len(params):
        raise ValueError(f"{cli_name} takes at most {len(params)} argument(s), got {len(values)}")
    arguments = {}
    for name, value in zip(params, values, strict=False):
        try:
            arguments[name] = _convert(value, params[name])
        except ValueError as exc:
            raise ValueError(f"{cli_name}: {name.upper()}: {exc}") from None
    missing = [name.upper() for name, param in params.items() if param.required and name not in arguments]
    if missing:
        raise ValueError(f"{cli_name}: missing {', '.join(missing)}")
    try:
        command.bind(arguments)
    except TypeError as exc:
        raise ValueError(f"{cli_name}: {exc}") from None
    return arguments


def _usage(cli_name: str, command: Command) -> str:
    # ``usage: ctl control rate-limit TASK_NAME RATE_LIMIT`` (optional ones in brackets).
    words = [
        name.upper() if param.required else f"[{name.upper()}]" for name, param in command.params.items()
    ]
    return f"usage: ctl control {' '.join([cli_name, *words])}"


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


def status_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl status``: a ping, printed as one line per node and a count."""
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


def revoke_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl revoke ID...``: the revocation log first, then the broadcast; 0 once logged.

    Raises:
        ValueError: a malformed task id.
    """
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


def shutdown_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl shutdown``: ask the workers to shut down (warm); no replies are awaited."""
    client.broadcast("shutdown", destination=dest, timeout_s=args.timeout)
    err.write(f"shutdown sent to {', '.join(dest) if dest else 'all nodes'}\n")
    return EX_OK


def _status(result: BroadcastResult, err: TextIO) -> int:
    # The exit status from who answered (the module docstring of control/cli/main.py).
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
