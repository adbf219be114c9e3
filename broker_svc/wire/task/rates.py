"""Task rate limits as Celery writes them (``"10/s"``, ``"100/m"``, ``"2/h"``), in tokens per second."""

from __future__ import annotations

import math
from typing import Final

__all__ = ["RATE_UNITS", "parse_rate"]

# Seconds per unit, as Celery's ``celery.utils.time.RATE_MODIFIER_MAP``; no unit means per second.
RATE_UNITS: Final = {"s": 1.0, "m": 60.0, "h": 3600.0}

_HINT: Final = 'use "<number>/<unit>" with unit s, m or h (e.g. "10/s", "100/m", "2/h"), or None for no limit'


def parse_rate(value: str | int | float | None) -> float | None:
    """Tokens per second of a rate limit, or None when there is no limit.

    Accepts what Celery's ``rate()`` accepts: ``"10/s"``, ``"100/m"``, ``"2/h"``, ``"0.5/s"``, a bare
    ``"10"`` or ``10`` (per second). ``None``, ``""`` and zero (``0``, ``"0/m"``) mean no limit.
    Unlike Celery, a negative or non-finite rate is refused instead of silently misbehaving.

    Args:
        value: the rate as a task option or a ``rate_limit`` control argument carries it.

    Returns:
        The rate in tokens per second (> 0), or None for no limit.

    Raises:
        ValueError: ``value`` is not a rate (bad number or unit, negative, infinite, not a str/number).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"invalid rate limit {value!r}: expected a string or a number; {_HINT}")
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return None
        number, _, unit = text.partition("/")
        number, unit = number.strip(), unit.strip() or "s"
        if unit not in RATE_UNITS:
            raise ValueError(f"invalid rate limit {value!r}: unknown unit {unit!r}; {_HINT}")
        try:
            amount = float(number)
        except ValueError:
            raise ValueError(f"invalid rate limit {value!r}: {number!r} is not a number; {_HINT}") from None
        per_second = amount / RATE_UNITS[unit]
    else:
        amount = per_second = float(value)
    if not math.isfinite(amount):
        raise ValueError(f"invalid rate limit {value!r}: it must be a finite number; {_HINT}")
    if amount < 0:
        raise ValueError(f"invalid rate limit {value!r}: it must not be negative; {_HINT}")
    if amount == 0:
        return None
    if per_second == 0 or not math.isfinite(1.0 / per_second):
        raise ValueError(f"invalid rate limit {value!r}: it is too small to represent; {_HINT}")
    return per_second
