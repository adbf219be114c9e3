"""Our worker in Dramatiq's drain shape: ``-c 2 --threads 8 --prefetch-multiplier 2``.

Dramatiq's benchmark worker is ``-p 2 -t 8``: 16 tasks run at once, with 32 prefetched (twice the
threads per process). Ours runs 16 at once too, each child's 8 threads sharing one connection with
prefetch 16: the same 32 unacked. (At the default multiplier of 1 a worker holds no task it cannot
start at once; at 2, as Dramatiq, one waits behind each thread.) The default ``-c 2`` runs 2 at
once. Only the task-path scenarios where the shape matters are run.
"""

from __future__ import annotations

import os
import sys

from bench import driver
from bench.ours import THREADS_PREFETCH, WORKER_ARGS, Clockwork
from bench.systems import THREADS
from broker_svc.logging import configure_logging

DRAIN_THREADS = 8  # per child, as Dramatiq's -t 8


def main() -> int:
    configure_logging("warning")
    os.environ["BENCH_WORKER_ARGS"] = WORKER_ARGS
    return driver.main(
        THREADS,
        lambda job: Clockwork(
            job.broker_url,
            wide=job.wide,
            extra_worker_args=["--threads", str(DRAIN_THREADS), *THREADS_PREFETCH],
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
