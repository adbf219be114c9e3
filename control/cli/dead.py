"""``ctl dead list|show|requeue|purge``: the dead letters of ``<queue>.dead``, through ``DeadLetters``.

Exit status: 0 when done (an empty list too), 1 when an id has no dead letter, a dead queue is busy
with another ``ctl``, the broker refuses a copy or cannot be reached, 2 for usage errors (``purge``
without ``--yes``, ``requeue`` with neither ids nor ``--all``). Its arguments are in
``control/cli/parser.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any, TextIO

from broker_svc.errors import DeadLetterNotFound, DeadQueueBusy, PublishNacked
from broker_svc.wire.records.dead_letter import (
    DeadLetter,
    RequeueResult,
    jsonable,
    view_body,
)
from control.blocking.client import ControlClient
from control.blocking.dead_letters import DeadLetters
from control.cli.exit_codes import EX_FAILURE, EX_OK
from control.cli.render import Style
from control.protocol.request import flatten_replies

__all__ = ["dead_command", "format_letter", "format_letters", "format_requeued"]


def dead_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """Run ``ctl dead OP``.

    Raises:
        ValueError: a usage error (exit 2).
        BrokerUnavailable: the broker cannot be reached.
    """
    _check_usage(args)
    letters = DeadLetters(
        client.settings,
        discover=lambda: _consumed(client, dest, args.timeout),
        clock=client.clock,
        hostname=client.hostname,
        lock_wait_s=args.timeout,
    )
    try:
        if args.op == "list":
            return _list(letters, args, out)
        if args.op == "show":
            return _show(letters, args, out)
        if args.op == "requeue":
            return _requeue(letters, args, out)
        return _purge(letters, args, out, err)
    except (DeadLetterNotFound, DeadQueueBusy, PublishNacked, ValueError) as exc:
        err.write(f"ctl: {exc}\n")
        return EX_FAILURE


def _check_usage(args: argparse.Namespace) -> None:
    # Before connecting: a mistyped command changes nothing.
    if args.op == "list" and args.limit is not None and args.limit <= 0:
        raise ValueError("--limit must be positive")
    if args.op == "requeue" and bool(args.ids) == bool(args.all):
        raise ValueError("ctl dead requeue: name task ids, or --all (not both)")
    if args.op == "purge" and not args.yes:
        where = f"{args.queue}'s dead letters" if args.queue else "the dead letters of every dead queue found"
        raise ValueError(f"ctl dead purge deletes {where} for good; add --yes to do it")


def _list(letters: DeadLetters, args: argparse.Namespace, out: TextIO) -> int:
    found = letters.list(args.queue, limit=args.limit)
    if args.json:
        out.write(json.dumps([letter.as_dict() for letter in found]) + "\n")
    else:
        out.write(format_letters(found, Style.for_stream(out)))
    return EX_OK


def _show(letters: DeadLetters, args: argparse.Namespace, out: TextIO) -> int:
    found = letters.show(args.id, queue=args.queue)
    if args.json:
        out.write(json.dumps([letter.as_dict(full=True) for letter in found], indent=2) + "\n")
    else:
        out.write("\n".join(format_letter(letter, Style.for_stream(out)) for letter in found))
    return EX_OK


def _requeue(letters: DeadLetters, args: argparse.Namespace, out: TextIO) -> int:
    if args.all:
        result = letters.requeue_all(args.queue, to=args.to)
    else:
        result = letters.requeue(*args.ids, queue=args.queue, to=args.to)
    out.write(json.dumps(result.as_dict()) + "\n" if args.json else format_requeued(result))
    return EX_OK


def _purge(letters: DeadLetters, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    purged = letters.purge(args.queue)
    if args.json:
        out.write(json.dumps(purged) + "\n")
    else:
        for name, count in purged.items():
            out.write(f"purged {count} message{'s' if count != 1 else ''} from {name}\n")
    if not purged:
        err.write("no dead queue found: nothing purged\n")
    return EX_OK


def format_letters(letters: list[DeadLetter], style: Style) -> str:
    """A row per dead letter: id, task, reason, when, the queue it came from."""
    if not letters:
        return "no dead letters\n"
    rows = [["ID", "TASK", "REASON", "DEAD AT (UTC)", "QUEUE"]]
    for letter in letters:
        rows.append([
            _clean(letter.task_id or "-"), _clean(letter.task or "-"), _clean(letter.reason or "-"),
            _when(letter.dead_at), _clean(letter.queue),
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    count = len(letters)
    return (
        "\n".join([style.node(lines[0]), *lines[1:], f"\n{count} dead letter{'s' if count != 1 else ''}"])
        + "\n"
    )


def format_letter(letter: DeadLetter, style: Style) -> str:
    """One dead letter in full: what it is, why it is here, its properties, headers and body."""
    lines = [
        f"{style.node('id')}        {_clean(letter.task_id or '-')}",
        f"task      {_clean(letter.task or '-')}",
        f"queue     {_clean(letter.queue)} (kept in {_clean(letter.dead_queue)})",
        f"reason    {style.error(_clean(letter.reason or '-'))}",
        f"error     {_clean(letter.error or '-')}",
        f"dead at   {_clean(letter.dead_at or '-')}",
        f"requeued  {letter.requeued} time{'s' if letter.requeued != 1 else ''} before",
        "properties",
        *(f"  {name}: {_value(value)}" for name, value in letter.properties.items()),
        "headers",
        *(f"  {_clean(name)}: {_value(value)}" for name, value in sorted(letter.headers.items())),
    ]
    body = view_body(letter)
    head = f"body ({_clean(body.content_type or 'no content type')}, {body.size} bytes"
    if body.decoded:
        lines.append(head + ")")
        value = body.value
        if isinstance(value, list) and len(value) == 3:  # a protocol-v2 task: [args, kwargs, embed]
            lines.extend(
                f"  {name}: {_value(part)}"
                for name, part in zip(("args", "kwargs", "embed"), value, strict=True)
            )
        else:
            lines.append(f"  {_value(value)}")
    else:
        lines.append(head + f", not decoded: {_clean(body.why or '')})")
        lines.append(f"  {body.excerpt}")
    return "\n".join(lines) + "\n"


def format_requeued(result: RequeueResult) -> str:
    """A line per dead letter sent back, and a count."""
    lines = []
    for item in result.requeued:
        letter = item.letter
        name = f"{_clean(letter.task_id or '(no id)')} ({_clean(letter.task or '?')})"
        if item.earlier:
            lines.append(
                f"{name}: sent to {_clean(item.queue)} by a requeue cut short; its dead letter is now acked"
            )
        else:
            lines.append(f"requeued {name} from {_clean(letter.dead_queue)} to {_clean(item.queue)}")
    count = sum(1 for item in result.requeued if not item.earlier)
    lines.append(f"{count} requeued" if result.requeued else "nothing to requeue")
    if result.markers_cleared:
        lines.append(f"{result.markers_cleared} marker(s) of requeues cut short removed")
    return "\n".join(lines) + "\n"


def _consumed(client: ControlClient, dest: list[str] | None, timeout_s: float) -> list[str]:
    # The queues the answering workers consume, in the order first seen.
    result = client.broadcast("active_queues", destination=dest, reply=True, timeout_s=timeout_s)
    names: list[str] = []
    for consumed in flatten_replies(result.replies).values():
        for queue in consumed if isinstance(consumed, list) else ():
            name = queue.get("name") if isinstance(queue, dict) else None
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names


def _when(value: str | None) -> str:
    if value is None:
        return "-"
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        return _clean(value)
    return (
        at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if at.tzinfo else at.strftime("%Y-%m-%d %H:%M:%S")
    )


def _value(value: Any) -> str:
    # JSON escapes every control character, so a header or argument cannot drive the terminal.
    return json.dumps(jsonable(value))


def _clean(text: str) -> str:
    # Anyone who can publish writes these: no control character reaches the terminal as it is.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
