"""How ``ctl`` prints replies and events for a person (``--json`` prints them as they are).

Each inspect method has a layout of its own (a table of tasks, a worker's figures with their units,
a queue per line); anything else is a summary line per node with its items below. Colour is used
on a terminal only, and never with ``NO_COLOR`` set.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from collections.abc import Callable
from typing import Any, Final, TextIO

__all__ = [
    "Style",
    "format_event",
    "format_nodes",
    "human_bytes",
    "human_seconds",
    "is_error",
    "is_ok",
    "queue_table",
    "show",
    "summarize",
    "top_screen",
]


class Style:
    """ANSI colour for a terminal, or none (``NO_COLOR``, a pipe, a file)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    @classmethod
    def for_stream(cls, out: TextIO) -> Style:
        """Colour when ``out`` is a terminal and ``NO_COLOR`` is not set (no-color.org)."""
        isatty = getattr(out, "isatty", None)
        return cls(bool(isatty and isatty()) and "NO_COLOR" not in os.environ)

    def _wrap(self, code: str, text: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.enabled else text

    def ok(self, text: str) -> str:
        return self._wrap("32", text)

    def error(self, text: str) -> str:
        return self._wrap("31;1", text)

    def node(self, text: str) -> str:
        return self._wrap("1", text)

    def dim(self, text: str) -> str:
        return self._wrap("2", text)


_PLAIN: Final = Style(False)


def show(
    by_node: dict[str, Any], as_json: bool, out: TextIO, *, method: str | None = None, style: Style = _PLAIN
) -> None:
    """Write ``{node: value}`` for a person (a layout per inspect ``method``), or as one JSON line."""
    if as_json:
        out.write(json.dumps(by_node, default=str) + "\n")
        return
    width = max((len(node) for node in by_node), default=0)
    layout = _LAYOUTS.get(method or "")
    for node, value in by_node.items():
        if method == "report" and is_ok(value) and isinstance(value["ok"], str):
            # A text report: its lines under the node, not squeezed into a summary.
            out.write(f"{style.node(node.ljust(width))}  {style.ok('OK')}\n")
            lines = value["ok"].strip("\n").splitlines()
        elif is_error(value) or is_ok(value) or layout is None:
            out.write(f"{style.node(node.ljust(width))}  {_summary(value, style)}\n")
            lines = [] if is_error(value) or is_ok(value) else _details(value)
        else:
            head, lines = layout(value)
            out.write(f"{style.node(node.ljust(width))}  {head}\n")
        for line in lines:
            out.write(f"{'':<{width}}    {line}\n")


def is_ok(value: Any) -> bool:
    """Whether a reply is ``{"ok": ...}`` (a control command that worked)."""
    return isinstance(value, dict) and "ok" in value and "error" not in value


def is_error(value: Any) -> bool:
    """Whether a reply is Celery's error reply, ``{"error": ...}`` (the command failed there)."""
    return isinstance(value, dict) and "error" in value


def summarize(value: Any) -> str:
    """One reply in a few words: ``OK pong``, ``ERROR ...``, ``3 items``, ``5 keys``."""
    return _summary(value, _PLAIN)


def _summary(value: Any, style: Style) -> str:
    if isinstance(value, dict) and len(value) == 1 and ("ok" in value or "error" in value):
        [(key, inner)] = value.items()
        word = style.ok("OK") if key == "ok" else style.error("ERROR")
        return f"{word} {_short(inner)}"
    if isinstance(value, list):
        return f"{len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"{len(value)} key{'s' if len(value) != 1 else ''}"
    return _short(value)


# -- units -------------------------------------------------------------------------------------------


def human_seconds(seconds: float) -> str:
    """``92 µs``, ``12 ms``, ``3.2 s``, ``4m 05s``, ``1h 02m``, ``2d 03h``."""
    if seconds < 0.001:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def human_bytes(count: float) -> str:
    """``512 B``, ``1.5 KiB``, ``48.2 MiB``, ``1.1 GiB``."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover - the loop returns


def _map(value: Any, key: str) -> dict[str, Any]:
    inner = value.get(key) if isinstance(value, dict) else None
    return inner if isinstance(inner, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# -- a layout per inspect method: (head line, detail lines) ------------------------------------------


def _tasks(value: Any) -> tuple[str, list[str]]:
    # active / reserved: Celery's task info maps.
    items = value if isinstance(value, list) else []
    now = time.time()
    rows = []
    for task in items:
        if not isinstance(task, dict):
            continue
        started = _number(task.get("time_start"))
        when = f"running {human_seconds(max(0.0, now - started))}" if started else "waiting"
        rows.append([
            str(task.get("id", "?")), str(task.get("name", "?")), _short(_arguments(task), 60), when,
            f"pid {task['worker_pid']}" if task.get("worker_pid") else "",
        ])  # fmt: skip
    return _count(len(rows), "task"), _table(rows)


def _arguments(task: dict[str, Any]) -> str:
    # ``(1, 2) {'size': 3}``: the positional and the keyword arguments, each as the worker sent it
    # (its repr strings with --safe or from a Celery worker's argsrepr, else the values).
    args = task.get("argsrepr") or task.get("args")
    kwargs = task.get("kwargsrepr") or task.get("kwargs")
    text = args if isinstance(args, str) else repr(tuple(args)) if isinstance(args, list) else _short(args)
    if isinstance(kwargs, dict):
        kwargs = repr(kwargs) if kwargs else None
    if kwargs and kwargs != "{}":
        text = f"{text} {kwargs}"
    return text


def _scheduled(value: Any) -> tuple[str, list[str]]:
    items = value if isinstance(value, list) else []
    rows = []
    for entry in items:
        if not isinstance(entry, dict):
            continue
        request = _map(entry, "request")
        rows.append([str(request.get("id", "?")), str(request.get("name", "?")), f"eta {entry.get('eta')}"])
    return _count(len(rows), "task"), _table(rows)


def _stats(value: Any) -> tuple[str, list[str]]:
    if not isinstance(value, dict):
        return _short(value), []
    pool = _map(value, "pool")
    totals = _map(value, "total")
    done = sum(int(n) for n in totals.values() if isinstance(n, int))
    uptime = _number(value.get("uptime"))
    head = f"up {human_seconds(uptime)}" if uptime is not None else "up ?"
    head += f", {done} task{'s' if done != 1 else ''} done, pid {value.get('pid')}"
    lines = []
    processes = pool.get("processes")
    processes = processes if isinstance(processes, list) else []
    lines.append(f"pool: {len(processes)} processes (max {pool.get('max-concurrency')}), "
                 f"prefetch {value.get('prefetch_count')}")  # fmt: skip
    for name, count in sorted(totals.items(), key=lambda item: -item[1] if isinstance(item[1], int) else 0)[
        :5
    ]:
        lines.append(f"  {count:>8}  {name}")
    rusage = _map(value, "rusage")
    utime, stime, maxrss = (
        _number(rusage.get("utime")),
        _number(rusage.get("stime")),
        _number(rusage.get("maxrss")),
    )
    if utime is not None and stime is not None:
        memory = f", max RSS {human_bytes(maxrss * 1024)}" if maxrss is not None else ""
        lines.append(f"cpu: user {human_seconds(utime)}, system {human_seconds(stime)}{memory}")
    broker = _map(value, "broker")
    if broker:
        lines.append(
            f"broker: {broker.get('hostname')}:{broker.get('port')} vhost {broker.get('virtual_host')!r}"
        )
    unknown = value.get("unknown_tasks")
    if isinstance(unknown, dict) and unknown:
        shown = ", ".join(f"{name} ×{count}" for name, count in unknown.items())
        lines.append(f"unknown tasks (dead-lettered): {shown}")
    autoscaler = value.get("autoscaler")
    if isinstance(autoscaler, dict):
        bounds = f"max {autoscaler.get('max')}, min {autoscaler.get('min')}"
        lines.append(f"autoscale: {bounds}, demand {autoscaler.get('qty')}")
    return head, lines


def _queues(value: Any) -> tuple[str, list[str]]:
    items = value if isinstance(value, list) else []
    rows = []
    for queue in items:
        if not isinstance(queue, dict):
            continue
        exchange = _map(queue, "exchange")
        arguments = _map(queue, "queue_arguments")
        kind = arguments.get("x-queue-type", "classic")
        rows.append([
            str(queue.get("name")), str(kind), "durable" if queue.get("durable") else "transient",
            f"exchange {exchange.get('name')!r} ({exchange.get('type')})",
            f"key {queue.get('routing_key')!r}",
        ])  # fmt: skip
    return _count(len(rows), "queue"), _table(rows)


def _dedup(value: Any) -> tuple[str, list[str]]:
    if not isinstance(value, dict):
        return _short(value), []
    shards = value.get("active_shards") or []
    keys, waiting = value.get("keys", 0), value.get("waiting", 0)
    owned = value.get("owned_shards")
    head = f"keeps {len(shards)} shard(s) {shards}, {keys} key(s), {waiting} waiting"
    if owned is not None and owned != shards:
        head += f" (owns {owned})"  # moving: handed over, or waiting for the shard's owner to take it
    counts = [
        f"{name} {value.get(name, 0)}" for name in ("accepted", "blocked", "declined", "evicted", "released")
    ]
    return head, [", ".join(counts)]


def _clock(value: Any) -> tuple[str, list[str]]:
    return (f"clock {value.get('clock')}" if isinstance(value, dict) else _short(value)), []


_LAYOUTS: Final[dict[str, Callable[[Any], tuple[str, list[str]]]]] = {
    "active": _tasks,
    "reserved": _tasks,
    "scheduled": _scheduled,
    "stats": _stats,
    "active_queues": _queues,
    "clock": _clock,
    "dedup": _dedup,
}


# Tasks wait in a queue nobody consumes until a worker does: the likeliest cause of "my task never
# ran" (a -Q that does not name it, a route to a typo), so it is said where the numbers are.
_NO_CONSUMER = "no consumer: start a worker with -Q for it"


def queue_table(rows: dict[str, dict[str, Any]], style: Style) -> str:
    """``ctl queues``: a row per queue, a header, and the rate as a signed change per second."""
    table = [["QUEUE", "READY", "HELD", "CONSUMERS", "DEAD", "RATE"]]
    for name, row in rows.items():
        if not row.get("exists"):
            table.append([name, "-", "-", "-", "-", "no such queue"])
            continue
        rate = float(row["rate_per_s"])
        trend = "steady" if rate == 0 else f"{rate:+.1f}/s ({'growing' if rate > 0 else 'draining'})"
        if row.get("no_consumer"):
            trend += f"; {style.error(_NO_CONSUMER)}"
        table.append([
            name, str(row["ready"]), str(row["held_by_workers"]), str(row["consumers"]), str(row["dead"]),
            trend,
        ])  # fmt: skip
    lines = _table(table)
    return "\n".join([style.node(lines[0]), *lines[1:]]) + "\n"


def top_screen(
    stats: dict[str, Any],
    active: dict[str, Any],
    depths: dict[str, Any],
    rates: dict[str, float],
    *,
    style: Style,
    clock: str,
) -> str:
    """``ctl top``: the workers (busy children, tasks done, uptime), their running tasks, the queues."""
    lines = [style.node(f"clockwork top  {clock}  {_count(len(stats), 'worker')}"), ""]
    workers = [["WORKER", "BUSY", "DONE", "UP", "PREFETCH"]]
    for node, value in sorted(stats.items()):
        if not isinstance(value, dict):
            workers.append([node, "?", "?", "?", "?"])
            continue
        pool = _map(value, "pool")
        running = active.get(node)
        busy = len(running) if isinstance(running, list) else 0
        totals = _map(value, "total")
        done = sum(int(n) for n in totals.values() if isinstance(n, int))
        uptime = _number(value.get("uptime"))
        workers.append([
            node, f"{busy}/{pool.get('max-concurrency', '?')}", str(done),
            human_seconds(uptime) if uptime is not None else "?", str(value.get("prefetch_count", "?")),
        ])  # fmt: skip
    lines.extend(_table(workers))
    tasks = []
    now = time.time()
    for node, running in sorted(active.items()):
        for task in running if isinstance(running, list) else ():
            if isinstance(task, dict):
                started = _number(task.get("time_start"))
                took = human_seconds(max(0.0, now - started)) if started else "-"
                tasks.append([str(task.get("id", "?")), str(task.get("name", "?")), node, took])
    lines.append("")
    if tasks:
        lines.extend(_table([["TASK", "NAME", "WORKER", "RUNNING"], *sorted(tasks, key=lambda row: row[3])]))
    else:
        lines.append(style.dim("no task running"))
    queue_rows = [["QUEUE", "READY", "CONSUMERS", "RATE"]]
    for name, depth in sorted(depths.items()):
        if depth is None:
            continue
        rate = rates.get(name)
        shown = "-" if rate is None else ("steady" if rate == 0 else f"{rate:+.1f}/s")
        if depth.ready and not depth.consumers:
            shown += f"; {style.error(_NO_CONSUMER)}"
        queue_rows.append([name, str(depth.ready), str(depth.consumers), shown])
    if len(queue_rows) > 1:
        lines.append("")
        lines.extend(_table(queue_rows))
    return "\n".join(lines) + "\n"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _table(rows: list[list[str]]) -> list[str]:
    # Columns padded to their widest cell; the last one is not padded.
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    last = len(widths) - 1
    return ["  ".join(cell if i == last else cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()
            for row in rows]  # fmt: skip


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
        value = event.get(key)
        if value is None:
            continue
        if key == "runtime" and isinstance(value, int | float) and not isinstance(value, bool):
            parts.append(f"runtime={_runtime(value)}")
        else:
            parts.append(f"{key}={_short(value, 80)}")
    return " ".join(parts)


def _runtime(seconds: float) -> str:
    # Three significant digits, not a float's seventeen; no space, so the line stays key=value.
    if float(f"{seconds:.3g}") < 1:
        return f"{seconds * 1000:.3g}ms"
    if float(f"{seconds:.3g}") < 60:
        return f"{seconds:.3g}s"
    return human_seconds(seconds).replace(" ", "")


def format_nodes(nodes: frozenset[str]) -> str:
    """``2 nodes: a@h, b@h``."""
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}: {', '.join(sorted(nodes))}"
