"""How ``ctl`` prints replies and events for a person (``--json`` prints them as they are)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, TextIO

__all__ = ["format_event", "format_nodes", "is_ok", "show", "summarize"]


def show(by_node: dict[str, Any], as_json: bool, out: TextIO) -> None:
    """Write ``{node: value}``: a summary line per node, then its items indented (or one JSON line)."""
    if as_json:
        out.write(json.dumps(by_node, default=str) + "\n")
        return
    width = max((len(node) for node in by_node), default=0)
    for node, value in by_node.items():
        out.write(f"{node:<{width}}  {summarize(value)}\n")
        for line in _details(value):
            out.write(f"{'':<{width}}    {line}\n")


def is_ok(value: Any) -> bool:
    """Whether a reply is ``{"ok": ...}`` (a control command that worked)."""
    return isinstance(value, dict) and "ok" in value and "error" not in value


def is_error(value: Any) -> bool:
    """Whether a reply is Celery's error reply, ``{"error": ...}`` (the command failed there)."""
    return isinstance(value, dict) and "error" in value


def summarize(value: Any) -> str:
    """One reply in a few words: ``OK pong``, ``ERROR ...``, ``3 items``, ``5 keys``."""
    if isinstance(value, dict) and len(value) == 1 and ("ok" in value or "error" in value):
        [(key, inner)] = value.items()
        return f"{'OK' if key == 'ok' else 'ERROR'} {_short(inner)}"
    if isinstance(value, list):
        return f"{len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"{len(value)} key{'s' if len(value) != 1 else ''}"
    return _short(value)


def _details(value: Any) -> list[str]:
    if isinstance(value, list):
        return [f"- {_short(item)}" for item in value]
    if isinstance(value, dict) and not (len(value) == 1 and ("ok" in value or "error" in value)):
        return [f"{key}: {_short(inner)}" for key, inner in value.items()]
    return []


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_event(event: dict[str, Any]) -> str:
    """One event as a line: time, clock, hostname, type, then the task fields it has."""
    timestamp = event.get("timestamp")
    when = (
        dt.datetime.fromtimestamp(timestamp, dt.UTC).isoformat(timespec="milliseconds")
        if isinstance(timestamp, int | float) and not isinstance(timestamp, bool)
        else "-"
    )
    parts = [when, f"clock={event.get('clock')}", str(event.get("hostname")), str(event.get("type"))]
    for key in ("uuid", "name", "runtime", "result", "exception"):
        if event.get(key) is not None:
            parts.append(f"{key}={_short(event[key], 80)}")
    return " ".join(parts)


def format_nodes(nodes: frozenset[str]) -> str:
    """``2 nodes: a@h, b@h``."""
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {', '.join(sorted(nodes))}"
