"""Our subject with ``--children-consume`` (issue 16): each pool child consumes for itself."""

from __future__ import annotations

import os
import sys

from bench import driver
from bench.ours import WORKER_ARGS, Clockwork
from bench.systems import CHILDREN
from broker_svc.logging import configure_logging


def main() -> int:
    configure_logging("warning")
    os.environ["BENCH_WORKER_ARGS"] = WORKER_ARGS
    return driver.main(
        CHILDREN,
        lambda job: Clockwork(job.broker_url, wide=job.wide, extra_worker_args=["--children-consume"]),
    )


if __name__ == "__main__":
    sys.exit(main())
