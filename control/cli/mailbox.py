"""``ctl inspect``, ``control``, ``status``, ``revoke`` and ``shutdown``: one request over the mailbox,
its replies printed, and the exit status from who answered (see ``control/cli/main.py``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_FAILURE, EX_OK, EX_UNAVAILABLE
from control.cli.parser import CONTROL_METHODS, INSPECT_METHODS
from control.cli.render import Style, format_nodes, is_error, is_ok, show, summarize
from control.protocol.commands import Param
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

    Raises:
        ValueError: too many arguments, or one of the wrong type.
    """
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
