"""``ctl events``: live events as they come, put back in Lamport order, until a count or a duration."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Final, TextIO

from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_OK
from control.cli.render import format_event
from control.protocol.event_order import ReorderBuffer

__all__ = ["events_command"]

_REORDER_WINDOW_S: Final = 0.5


def events_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """Print events until ``--count`` of them or ``--duration`` seconds, or Ctrl-C; always 0.

    Raises:
        BrokerUnavailable: the broker cannot be reached, or the connection was lost.
    """
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
