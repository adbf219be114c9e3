"""``ctl queues`` and ``ctl top``: how the queues and workers are doing, sampled over time.

Both read the queues' depths with passive declares (no management plugin) and what the workers
run through the mailbox; a rate is the change in a queue's ready messages between two samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any, TextIO

from control.blocking.client import ControlClient
from control.cli.exit_codes import EX_OK, EX_UNAVAILABLE
from control.cli.render import Style, queue_table, top_screen
from control.protocol.request import flatten_replies

__all__ = ["queues_command", "top_command"]


def queues_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl queues``: ready, held by workers, consumers, dead letters and rate, per queue."""
    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    held: dict[str, int] = {}
    for method in ("active", "reserved"):
        for tasks in _ask(client, method, dest, args.timeout).values():
            for task in tasks if isinstance(tasks, list) else ():
                key = task.get("delivery_info", {}).get("routing_key") if isinstance(task, dict) else None
                if isinstance(key, str):
                    held[key] = held.get(key, 0) + 1
    names = list(args.names) or _consumed(client, dest, args.timeout)
    if not names:
        err.write("No queues: no worker answered, and none was named.\n")
        return EX_UNAVAILABLE
    watched = [*names, *(f"{name}.dead" for name in names)]
    first, started = client.queue_depths(watched), time.monotonic()
    time.sleep(args.interval)  # the rate is the change between two samples
    second, elapsed = client.queue_depths(watched), time.monotonic() - started
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        now, before, dead = second.get(name), first.get(name), second.get(f"{name}.dead")
        if now is None:
            rows[name] = {"exists": False}
            continue
        rate = (now.ready - before.ready) / elapsed if before is not None else 0.0
        rows[name] = {
            "exists": True, "ready": now.ready, "held_by_workers": held.get(name, 0),
            "consumers": now.consumers, "dead": dead.ready if dead is not None else 0,
            "rate_per_s": round(rate, 1),
            "no_consumer": now.ready > 0 and now.consumers == 0,  # waiting for a worker that is not there
        }  # fmt: skip
    out.write(json.dumps(rows) + "\n" if args.json else queue_table(rows, Style.for_stream(out)))
    return EX_OK


def top_command(
    client: ControlClient, args: argparse.Namespace, dest: list[str] | None, out: TextIO, err: TextIO
) -> int:
    """``ctl top``: workers, running tasks and queues, redrawn every ``--interval`` until Ctrl-C."""
    if args.interval <= 0:
        raise ValueError("--interval must be positive")
    style = Style.for_stream(out)
    previous: dict[str, int] = {}
    last_at: float | None = None
    rounds = itertools.count(1) if args.iterations is None else range(1, args.iterations + 1)
    try:
        for round_number in rounds:
            started = time.monotonic()
            stats = _ask(client, "stats", dest, args.timeout)
            active = _ask(client, "active", dest, args.timeout)
            names = sorted(_consumed(client, dest, args.timeout))
            depths = client.queue_depths(names) if names else {}
            now = time.monotonic()
            rates = {
                name: (depth.ready - previous[name]) / (now - last_at)
                for name, depth in depths.items()
                if depth is not None and name in previous and last_at is not None
            }
            previous = {name: depth.ready for name, depth in depths.items() if depth is not None}
            last_at = now
            if style.enabled:
                out.write("\x1b[H\x1b[2J")  # redraw in place on a terminal
            out.write(top_screen(stats, active, depths, rates, style=style, clock=time.strftime("%H:%M:%S")))
            out.flush()
            if round_number != args.iterations:
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    return EX_OK


def _ask(client: ControlClient, method: str, dest: list[str] | None, timeout: float) -> dict[str, Any]:
    # ``{node: reply}`` of one inspect method.
    return flatten_replies(client.broadcast(method, destination=dest, reply=True, timeout_s=timeout).replies)


def _consumed(client: ControlClient, dest: list[str] | None, timeout: float) -> list[str]:
    # The queues the answering workers consume, in the order first seen.
    names: list[str] = []
    for consumed in _ask(client, "active_queues", dest, timeout).values():
        for queue in consumed if isinstance(consumed, list) else ():
            name = queue.get("name") if isinstance(queue, dict) else None
            if isinstance(name, str) and name not in names:
                names.append(name)
    return names
