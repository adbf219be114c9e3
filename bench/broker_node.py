"""The local RabbitMQ node through read-only ``rabbitmqctl eval``: its pid, its message counters.

Nothing here changes the node: ``os:getpid()`` and ``rabbit_global_counters:overview()`` are reads.
The counters are the node's own (``rabbit_global_counters``, what its Prometheus plugin exports)
and count every vhost, so a difference of two readings is one benchmark's only when no other vhost
was busy meanwhile; ``Reading.vhosts`` lists the vhosts that had connections, to say so.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Protocol-level counters (publishes) are labelled ``all``; delivery and ack counters, per queue type.
_READ = (
    "{[{proplists:get_value(queue_type, L, all), K, V} || {L, C} <- "
    "maps:to_list(rabbit_global_counters:overview()), lists:keymember(protocol, 1, L), "
    "{K, V} <- maps:to_list(C)], "
    "[proplists:get_value(vhost, I) || I <- rabbit_networking:connection_info_all([vhost])]}."
)
_COUNTER = re.compile(r"\{(\w+),(\w+),(\d+)\}")
_VHOST = re.compile(r'<<"([^"]*)">>')


def _eval(expression: str) -> str | None:
    try:
        done = subprocess.run(["rabbitmqctl", "eval", expression], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def node_pid() -> int | None:
    """The OS pid of the node ``rabbitmqctl`` talks to (the local broker), None if it cannot tell.

    Asked of the node itself: other ``beam.smp`` processes (test brokers) may run on the machine.
    """
    out = _eval("os:getpid().")
    try:
        pid = int((out or "").strip().strip('"'))
    except ValueError:
        return None
    return pid if Path(f"/proc/{pid}").exists() else None


@dataclass(frozen=True, slots=True)
class Reading:
    """The node's counters at one instant, and the vhosts that had connections then."""

    counters: dict[str, int]  # "<queue type or all>.<counter>"
    vhosts: frozenset[str]

    def since(self, before: Reading) -> dict[str, int]:
        """What each counter grew by since ``before``."""
        return {name: value - before.counters.get(name, 0) for name, value in self.counters.items()}


def read() -> Reading | None:
    """The node's global counters and connected vhosts; None if ``rabbitmqctl`` cannot be asked."""
    out = _eval(_READ)
    if out is None:
        return None
    counters = {f"{label}.{name}": int(value) for label, name, value in _COUNTER.findall(out)}
    return Reading(counters, frozenset(_VHOST.findall(out)))


def operations(grown: dict[str, int]) -> dict[str, int]:
    """Publishes, deliveries and acks in a counter difference (all queue types), and those of quorum
    queues alone."""

    def summed(name: str) -> int:
        return sum(value for key, value in grown.items() if key.endswith(f".{name}") and key[:3] != "all")

    return {
        "publishes": grown.get("all.messages_received_total", 0),
        "confirms": grown.get("all.messages_confirmed_total", 0),
        "deliveries": summed("messages_delivered_total"),
        "acks": summed("messages_acknowledged_total"),
        "quorum_deliveries": grown.get("rabbit_quorum_queue.messages_delivered_total", 0),
        "quorum_acks": grown.get("rabbit_quorum_queue.messages_acknowledged_total", 0),
    }
