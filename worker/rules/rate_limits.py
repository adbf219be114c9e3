"""Per-worker task rate limits: what a task's ``rate_limit`` means, and the mark of a parked copy.

The buckets themselves are in shared memory, taken by every child (``worker/shared/rates.py``).
"""

from __future__ import annotations

from typing import Final

from broker_svc.wire.task.rates import parse_rate

__all__ = ["RATE_RESERVED_HEADER", "parse_rate"]

# On a copy parked for its turn under a rate limit: it holds its token already.
RATE_RESERVED_HEADER: Final = "x-clockwork-rate-reserved"
