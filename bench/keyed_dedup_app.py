"""The app ``python -m bench.keyed_dedup`` runs its worker with: ``bench.tasks``'s no-op, and counters.

With ``BENCH_KEYED_COUNTS`` set to a file, the worker's main process (where the dedup gate runs)
counts its aio-pika channels' AMQP calls (``basic_publish``, ``basic_ack``, ``basic_nack``,
``basic_reject``, ``tx_commit``, on aiormq's ``Channel``) and writes them to that file as JSON
whenever it gets SIGUSR2. The main process consumes no tasks (its children do), so during a
benchmark these are the gate's calls (plus the control plane's, idle). The count costs a coroutine
call per AMQP call, about a microsecond. Pool children (their own connections) are not counted.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

from bench.tasks import app

__all__ = ["COUNTED", "COUNTS_ENV", "app"]

COUNTS_ENV = "BENCH_KEYED_COUNTS"
COUNTED = ("basic_publish", "basic_ack", "basic_nack", "basic_reject", "tx_commit")


def _count(path: Path) -> None:
    import aiormq  # the worker's main process has it; the pool children never import it

    counts: Counter[str] = Counter()
    waited = {"tx_commit_wait_s": 0.0}  # how long the gate awaited its commits, in all

    def counting(
        name: str, method: Callable[..., Coroutine[Any, Any, Any]]
    ) -> Callable[..., Coroutine[Any, Any, Any]]:
        async def counted(self: aiormq.Channel, *args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if name != "tx_commit":
                return await method(self, *args, **kwargs)
            started = time.perf_counter()
            try:
                return await method(self, *args, **kwargs)
            finally:
                waited["tx_commit_wait_s"] += time.perf_counter() - started

        return counted

    for name in COUNTED:
        setattr(aiormq.Channel, name, counting(name, getattr(aiormq.Channel, name)))

    def dump(signum: int, frame: FrameType | None) -> None:
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({**{name: counts[name] for name in COUNTED}, **waited}))
        partial.replace(path)  # whole or absent: the benchmark waits for the file to appear

    signal.signal(signal.SIGUSR2, dump)


_path = os.environ.get(COUNTS_ENV)
if _path and multiprocessing.parent_process() is None:  # the main process, not a pool child
    _count(Path(_path))
