"""The app ``python -m bench.beat`` runs under ``clockwork-beat``: many entries, nobody consuming.

``BENCH_BEAT_ENTRIES`` entries named ``e00000``... fire the task ``bench.beat.noop`` (not defined:
the scheduler sends by name) to the queue ``BENCH_BEAT_QUEUE``. ``BENCH_BEAT_SHAPE`` says when:

- ``burst``: every entry every 10 s, so all of them fall due at the same instants (the worst case);
- ``spread``: entry ``i`` every ``1 + i % 60`` seconds: each second fires the entries whose
  interval divides it (about 780 a second on average; at a whole minute, 12 intervals' worth).

``BENCH_BEAT_CATCH_UP`` is every entry's ``catch_up`` (default ``once``, the default: a scheduler
running behind fires an entry's latest missed instant only; ``all`` fires each one, late).
"""

from __future__ import annotations

import os
from typing import Any

from broker_svc import App

__all__ = ["app", "schedule"]


def schedule(entries: int, shape: str, queue: str, catch_up: str = "once") -> dict[str, dict[str, Any]]:
    """The ``beat_schedule`` of the benchmark (``catch_up``: each entry's policy).

    Raises:
        ValueError: an unknown shape.
    """
    if shape not in ("burst", "spread"):
        raise ValueError(f"BENCH_BEAT_SHAPE must be burst or spread, not {shape!r}")
    return {
        f"e{i:05d}": {
            "task": "bench.beat.noop",
            "schedule": 10.0 if shape == "burst" else float(1 + i % 60),
            "options": {"queue": queue},
            "catch_up": catch_up,
        }
        for i in range(entries)
    }


app = App("bench-beat")
app.conf.beat_schedule = schedule(
    int(os.environ.get("BENCH_BEAT_ENTRIES", "10000")),
    os.environ.get("BENCH_BEAT_SHAPE", "burst"),
    os.environ.get("BENCH_BEAT_QUEUE", "bench-beat-tasks"),
    os.environ.get("BENCH_BEAT_CATCH_UP", "once"),
)
