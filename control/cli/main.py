"""``ctl``: inspect and control workers from a shell (``ctl inspect ping``, ``ctl revoke ID``, ...).

Exit status: 0 when every addressed worker answered (the destination list, else the live members;
when membership is unknown, when anyone answered), 69 when none did (Celery's EX_UNAVAILABLE),
1 when some did not or the broker is unreachable, 2 for usage errors. A revoke that reached the
durable revocation log exits 0 even when no worker answered: workers apply it when they start.

With ``$CLOCKWORK_CONTROL_KEY`` set, requests are signed and unsigned replies dropped (see the
guide, "Securing the control plane"); requests carry the URL's user as ``user_id``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TextIO, TypeAlias

from broker_svc.errors import BrokerUnavailable, ConfigurationError
from broker_svc.logging import configure_logging
from control.cli.exit_codes import EX_FAILURE, EX_UNAVAILABLE
from control.cli.parser import build_parser

if TYPE_CHECKING:
    import argparse

    from control.blocking.client import ControlClient

__all__ = ["EX_UNAVAILABLE", "build_parser", "main"]

# Runs one command on a connected client: (client, args, destination, out, err) -> exit status.
Command: TypeAlias = "Callable[[ControlClient, argparse.Namespace, list[str] | None, TextIO, TextIO], int]"


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Entry point of ``ctl``; returns the exit status."""
    out, err = out or sys.stdout, err or sys.stderr
    parser = build_parser()
    args = parser.parse_args(argv)
    # Imported once the arguments are read: ``--help`` and usage errors need none of it.
    from broker_svc.settings import Settings
    from control.blocking.client import ControlClient

    # Deferred: structlog is loaded only if a warning is written, which a command that works never does.
    configure_logging("warning", defer=True)
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
    run = _command(args.command)
    try:
        with ControlClient(settings) as client:
            return run(client, args, destination, out, err)
    except BrokerUnavailable as exc:
        err.write(f"ctl: cannot reach the broker: {exc}\n")
        return EX_FAILURE
    except ValueError as exc:  # e.g. a malformed task id
        parser.error(str(exc))


def _command(name: str) -> Command:
    """The function that runs command ``name``, its module imported only now.

    A command's module brings what that command needs: ``ctl inspect ping`` loads neither the
    schedule, nor the task-state stream and the canvas behind it (``tests/unit/test_ctl_imports.py``).
    """
    if name == "events":
        from control.cli.events import events_command

        return events_command
    if name == "task":
        from control.cli.task_history import task_command

        return task_command
    if name == "schedule":
        from control.cli.schedule import schedule_command

        return schedule_command
    if name == "dead":
        from control.cli.dead import dead_command

        return dead_command
    if name in ("queues", "top"):
        from control.cli.watch import queues_command, top_command

        return queues_command if name == "queues" else top_command
    from control.cli import mailbox

    commands: dict[str, Command] = {
        "inspect": mailbox.inspect_command,
        "control": mailbox.control_command,
        "status": mailbox.status_command,
        "revoke": mailbox.revoke_command,
        "shutdown": mailbox.shutdown_command,
    }
    return commands[name]


if __name__ == "__main__":
    sys.exit(main())
