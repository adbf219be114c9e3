"""``Every``: an interval schedule anchored at the Unix epoch, so every process agrees on its instants."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Every"]


@dataclass(frozen=True)
class Every:
    """Fires at every whole multiple of ``seconds`` since 1970-01-01 00:00 UTC.

    ``Every(300)`` fires at :00, :05, :10... of every hour, whichever process computes it and
    whenever it started: unlike Celery's ``schedule`` (``relative=False``), the instants do not
    depend on when the scheduler last ran, so a new leader fires the same instants as the old one.

    Raises:
        ValueError: ``seconds`` is not a finite number above zero.
        TypeError: ``seconds`` is not a number.
    """

    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, int | float):
            raise TypeError(f"Every(seconds) takes a number of seconds, not {self.seconds!r}")
        if not math.isfinite(self.seconds) or self.seconds <= 0:
            raise ValueError(f"Every(seconds) must be a finite number above 0, not {self.seconds!r}")
        object.__setattr__(self, "seconds", float(self.seconds))

    def next_after(self, t: float) -> float:
        """The first ``k * seconds`` strictly after ``t`` (epoch seconds).

        Raises:
            ValueError: ``t`` is not a finite number.
        """
        if not math.isfinite(t):
            raise ValueError(f"next_after needs a finite time in epoch seconds, not {t!r}")
        k = math.floor(t / self.seconds) + 1
        # t / seconds rounds: step k so that k * seconds is the first multiple above t.
        while (k - 1) * self.seconds > t:
            k -= 1
        while k * self.seconds <= t:
            k += 1
        return k * self.seconds

    def to_json(self) -> dict[str, Any]:
        """``{"type": "every", "seconds": ...}``, for ``schedule_from_json``."""
        return {"type": "every", "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Every:
        """The interval ``to_json`` described.

        Raises:
            ValueError: not an interval's JSON, or a bad ``seconds``.
            TypeError: ``seconds`` is not a number.
        """
        if data.get("type") != "every" or set(data) != {"type", "seconds"}:
            raise ValueError(f"not an interval's JSON (keys 'type': 'every' and 'seconds'): {dict(data)!r}")
        return cls(data["seconds"])
