"""How long the command-line tools take to start: ``ctl`` (and ``celery`` beside it, when installed).

Usage: ``python -m bench.cli_start [--runs 20] [--ping [--broker URL]]``. Each command is run
``--runs`` times as a fresh process (``--help``: it imports what the tool imports, then exits without
a broker); prints one JSON line per command with the median and p90 wall time in milliseconds.

With ``--ping``, also ``ctl inspect ping`` as a command against one worker, in a vhost of its own
on the broker (default $CLOCKWORK_BROKER_URL, else the local one): ``bench.control``'s "ping as a
command" figure, alone and with more runs. Its first run is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

COMMANDS = {
    "ctl --help": ["ctl", "--help"],
    "ctl inspect ping --help": ["ctl", "inspect", "ping", "--help"],
    "clockwork-worker --help": ["clockwork-worker", "--help"],
    "celery --help": ["celery", "--help"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ping", action="store_true", help="also ctl inspect ping against one worker")
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    args = parser.parse_args()
    scripts = Path(sys.executable).parent
    for label, argv in COMMANDS.items():
        program = scripts / argv[0]
        if not program.exists() and shutil.which(argv[0]) is None:
            continue  # celery is a test-only dependency
        command = [str(program) if program.exists() else argv[0], *argv[1:]]
        _report(label, _timed(command, args.runs))
    if args.ping:
        _report("ctl inspect ping (1 worker)", _ping(args.broker, str(scripts / "ctl"), args.runs))


def _ping(broker: str, ctl: str, runs: int) -> list[float]:
    from bench.control import vhost
    from bench.spine import worker

    with vhost(broker) as url:
        queue = f"bench-cli-{uuid.uuid4().hex[:6]}"
        with worker(url, queue, 1, name=f"w0-{queue}@bench"):
            command = [ctl, "-b", url, "--timeout", "5", "inspect", "ping"]
            subprocess.run(command, capture_output=True, check=True)  # exits 0 only if the worker answered
            return _timed(command, runs)


def _timed(command: list[str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append((time.perf_counter() - started) * 1000)
    return times


def _report(label: str, times: list[float]) -> None:
    times = sorted(times)
    p90 = times[int(len(times) * 0.9) - 1]
    print(
        json.dumps(
            {"command": label, "median_ms": round(statistics.median(times), 1), "p90_ms": round(p90, 1)}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
