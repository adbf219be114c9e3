"""``ctl events``: live events as they come, put back in Lamport order, until a count or a duration."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any, Final, TextIO

from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_OK
from control.cli.render import format_event
from control.protocol.event_order import ReorderBuffer

__all__ = ["NO_TASK_EVENTS_HINT", "event_type_filter", "events_command"]

_REORDER_WINDOW_S: Final = 0.5
# Workers send only worker-* events unless told otherwise, as Celery's do: a user who sees only
# heartbeats should learn why at once, not from the docs.
NO_TASK_EVENTS_HINT: Final = (
    "workers send task-* events only when started with -E (--task-events) or after "
    "'ctl control enable-events'"
)


def event_type_filter(specs: Sequence[str] | None) -> tuple[frozenset[str], tuple[str, ...]] | None:
    """``--type`` values (repeated or comma-separated) as exact types and prefixes, or None for all.

    A value ending in ``-`` or ``*`` is a prefix (``task-`` and ``task-*`` match every task event).

    Raises:
        ValueError: a value names no type.
    """
    if not specs:
        return None
    exact: set[str] = set()
    prefixes: list[str] = []
    for spec in specs:
        for raw in spec.split(","):
            item = raw.strip()
            if not item.rstrip("*"):
                raise ValueError(
                    f"--type {spec!r} names no event type (e.g. task-failed, or task- for all task events)"
                )
            if item.endswith(("*", "-")):
                prefixes.append(item.rstrip("*"))
            else:
                exact.add(item)
    return frozenset(exact), tuple(prefixes)


def events_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """Print events until ``--count`` of them or ``--duration`` seconds, or Ctrl-C; always 0.

    Raises:
        BrokerUnavailable: the broker cannot be reached, or the connection was lost.
        ValueError: a ``--type`` value names no type.
    """
    wanted = event_type_filter(args.type)
    ordered = ReorderBuffer(_REORDER_WINDOW_S)
    deadline = time.monotonic() + args.duration if args.duration is not None else None
    printed = 0
    task_events = 0

    def shown(event: dict[str, Any]) -> bool:
        if dest and event.get("hostname") not in dest:
            return False
        if wanted is None:
            return True
        kind = str(event.get("type"))
        return kind in wanted[0] or kind.startswith(wanted[1])

    def emit(events: list[dict[str, Any]]) -> bool:
        nonlocal printed, task_events
        for event in events:
            if str(event.get("type")).startswith("task-"):
                task_events += 1
            if not shown(event):
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
                err.write(f"ctl: listening for events (Ctrl-C to stop); {NO_TASK_EVENTS_HINT}\n")
                err.flush()
            now = time.monotonic()
            for event in batch:
                ordered.push(event, now)
            if emit(ordered.pop_ready(now)):
                break
            if deadline is not None and now >= deadline:
                emit(ordered.drain())
                break
    except KeyboardInterrupt:
        emit(ordered.drain())
    if not task_events:
        err.write(f"ctl: no task events seen: {NO_TASK_EVENTS_HINT}\n")
    return EX_OK
