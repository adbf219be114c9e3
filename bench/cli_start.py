"""How long the command-line tools take to start: ``ctl`` (and ``celery`` beside it, when installed).

Usage: ``python -m bench.cli_start [--runs 20]``. Each command is run ``--runs`` times as a fresh
process (``--help``: it imports what the tool imports, then exits without a broker); prints one
JSON line per command with the median and p90 wall time in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
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
    args = parser.parse_args()
    scripts = Path(sys.executable).parent
    for label, argv in COMMANDS.items():
        program = scripts / argv[0]
        if not program.exists() and shutil.which(argv[0]) is None:
            continue  # celery is a test-only dependency
        command = [str(program) if program.exists() else argv[0], *argv[1:]]
        times = []
        for _ in range(args.runs):
            started = time.perf_counter()
            subprocess.run(command, capture_output=True, check=True)
            times.append((time.perf_counter() - started) * 1000)
        times.sort()
        p90 = times[int(len(times) * 0.9) - 1]
        print(
            json.dumps(
                {"command": label, "median_ms": round(statistics.median(times), 1), "p90_ms": round(p90, 1)}
            )
        )


if __name__ == "__main__":
    main()
