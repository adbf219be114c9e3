"""A producer process of the keyed-dedup stress runs: ``python -m tests.reliability.dedup_producer``.

It sends ``--bursts`` bursts of ``--burst-size`` keyed tasks, the first at ``--start-at`` (epoch
seconds, so every producer's bursts land together) and one every ``--period-s``. Each task's key is
``k<index>`` with index ``clamp(round(gauss(500, 120)), 0, 999)`` from a generator seeded with
``--seed`` and ``--producer``, so keys near the middle repeat often. Before each send it journals
``sent`` (key, task id, the wall time just before the send); once all are sent it waits for every
call's outcome and journals ``outcome`` (the call's state: SUCCESS, DECLINED, ...), then prints
``done`` and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time
import uuid
from pathlib import Path

from broker_svc import App, AsyncResult, Settings
from broker_svc.errors import ResultTimeout
from tests.reliability.dedup_stress_tasks import TASK

KEYS = 1000
KEY_MEAN, KEY_SIGMA = 500.0, 120.0
WORK_MS = (5, 40)


def key_index(rng: random.Random) -> int:
    """A key index with Gaussian repeats around the middle of the key space."""
    return min(KEYS - 1, max(0, round(rng.gauss(KEY_MEAN, KEY_SIGMA))))


def _append(path: Path, record: dict[str, object]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--producer", type=int, required=True)
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--bursts", type=int, default=1)
    parser.add_argument("--burst-size", type=int, required=True)
    parser.add_argument("--period-s", type=float, default=0.0)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--dedup-timeout", type=float, default=60.0)
    parser.add_argument("--results-timeout-s", type=float, default=120.0)
    args = parser.parse_args()
    rng = random.Random(f"{args.seed}-{args.producer}")
    calls: list[AsyncResult] = []
    with App(f"dedup-producer-{args.producer}", settings=Settings(broker_url=args.url)) as app:
        for burst in range(args.bursts):
            # Pacing, not a wait for state: each burst has its instant on the wall clock.
            threading.Event().wait(max(0.0, args.start_at + burst * args.period_s - time.time()))
            for _ in range(args.burst_size):
                key, task_id = f"k{key_index(rng):03d}", str(uuid.uuid4())
                work_ms = rng.randint(*WORK_MS)
                _append(args.journal, {"event": "sent", "key": key, "id": task_id, "at": time.time(),
                                       "producer": args.producer})  # fmt: skip
                calls.append(
                    app.send_task(
                        TASK,
                        (key, work_ms),
                        queue=args.queue,
                        task_id=task_id,
                        dedup_key=key,
                        dedup_timeout=args.dedup_timeout,
                    )  # fmt: skip
                )
        deadline = time.monotonic() + args.results_timeout_s
        for call in calls:
            try:
                value = call.get(timeout=max(0.1, deadline - time.monotonic()), propagate=False)
                state, error = call.state, "" if call.state == "SUCCESS" else type(value).__name__
            except ResultTimeout:
                state, error = "NO_OUTCOME", "ResultTimeout"
            _append(args.journal, {"event": "outcome", "id": call.id, "state": state, "error": error})
    print("done", flush=True)


if __name__ == "__main__":
    main()
