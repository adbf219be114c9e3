"""Lamport clock: one per process, forwarded on every send and adjusted on every receive."""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["MAX_CLOCK", "EventOrder", "LamportClock", "parse_clock"]

# Clock values travel as AMQP header ints that every peer (py-amqp, pika, pamqp) encodes as a
# signed 32-bit 'I'; anything above would change wire type or overflow a peer's field.
MAX_CLOCK = 2**31 - 1


def parse_clock(value: object) -> int | None:
    """Return ``value`` as a usable clock, or None when it is not one.

    Accepts ints (not bools) in ``[0, MAX_CLOCK]`` and decimal strings of them (Celery's ``stats``
    sends the clock as a string). Anything else — negatives, huge values, floats, garbage — is
    rejected so that one abusive peer cannot push every clock in the fleet to the limit.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        if not value.isdigit() or len(value) > 10:
            return None
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_CLOCK:
        return value
    return None


class LamportClock:
    """A thread-safe Lamport clock.

    Rules: ``forward()`` before every send; ``adjust(other)`` on every receive that carries a
    clock, which sets the clock to ``max(local, other) + 1``. Values saturate at ``MAX_CLOCK``.
    """

    __slots__ = ("_lock", "_value")

    def __init__(self, initial: int = 0) -> None:
        if parse_clock(initial) is None:
            raise ValueError(f"initial clock must be an int in [0, {MAX_CLOCK}], got {initial!r}")
        self._value = initial
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """The current value, without moving the clock."""
        return self._value

    def forward(self) -> int:
        """Advance the clock for a send and return the value to stamp on the message."""
        with self._lock:
            self._value = min(self._value + 1, MAX_CLOCK)
            return self._value

    def adjust(self, other: object) -> int:
        """Merge a received clock; invalid values are ignored and leave the clock as it was.

        Returns:
            The clock after the merge.
        """
        received = parse_clock(other)
        with self._lock:
            if received is None:
                return self._value
            self._value = min(max(self._value, received) + 1, MAX_CLOCK)
            return self._value


@dataclass(frozen=True, order=True, slots=True)
class EventOrder:
    """Total order of events: by clock, then by the sender's ``hostname.pid``."""

    clock: int
    origin: str
