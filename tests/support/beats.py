"""Start ``clockwork-beat`` processes for tests, and read what the scheduled tasks journaled."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tests.support.json_lines import read_json_lines
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess


class BeatProcess(WorkerProcess):
    """``python -m worker.beat`` in a subprocess; the log helpers are ``WorkerProcess``'s."""

    def __init__(
        self,
        url: str,
        *,
        scheduler: str,
        app: str = "tests.integration.beat_tasks:app",
        lease_s: float = 2.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = f"beat-{uuid.uuid4().hex[:6]}"
        self.args = []
        self._log = Path(tempfile.mkstemp(prefix="clockwork-beat-", suffix=".log")[1])
        self._logfile = self._log.open("w")
        cmd = [
            sys.executable, "-m", "worker.beat", "-A", app, "-b", url, "-l", "info",
            "--scheduler-name", scheduler, "--beat-lease", str(lease_s),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self._logfile,
            stderr=subprocess.STDOUT,
            env={**os.environ, "CLOCKWORK_BROKER_URL": url, **(env or {}), "PYTHONUNBUFFERED": "1"},
        )

    def __enter__(self) -> BeatProcess:
        return self

    def leading(self) -> bool:
        return self.count("beat_leading") > self.count("beat_stepped_down")


def schedule_env(entries: dict[str, dict[str, Any]], **extra: str) -> dict[str, str]:
    """The environment giving ``tests.integration.beat_tasks`` this ``beat_schedule``."""
    return {"BEAT_TEST_SCHEDULE": json.dumps(entries), **extra}


def runs(journal: Path) -> list[dict[str, Any]]:
    """What ``beat.tick`` journaled, in the order written."""
    return read_json_lines(journal)


def new_journal(directory: Path) -> Path:
    return Path(tempfile.mkstemp(dir=directory, prefix="beat-runs-", suffix=".jsonl")[1])


def tick_entry(journal: Path, queue: str, **extra: Any) -> dict[str, Any]:
    """A ``beat_schedule`` entry firing ``beat.tick`` every second to ``queue`` (``seconds``: how
    long each run takes; other keys are the entry's)."""
    seconds = extra.pop("seconds", 0.0)
    return {
        "task": "beat.tick",
        "schedule": 1.0,
        "args": [str(journal), seconds],
        "options": {"queue": queue},
        **extra,
    }


def wait_runs(journal: Path, count: int, timeout_s: float = 40.0) -> list[dict[str, Any]]:
    """Wait until ``journal`` holds ``count`` runs; all of them."""
    wait_for(lambda: len(runs(journal)) >= count, timeout_s=timeout_s, message=f"{count} runs in {journal}")
    return runs(journal)


def record_run(journal: str, request: Any, *, started: float, **extra: Any) -> None:
    """What ``beat.tick`` writes, in our app and in Celery's: one JSON line per run (one write,
    ``O_APPEND``: lines never interleave) with the id and the ``clockwork_beat_*`` headers."""
    headers = request.headers or {}
    scheduled = headers.get("clockwork_beat_scheduled")
    line = {
        "id": request.id,
        "entry": headers.get("clockwork_beat_entry"),
        "scheduled": dt.datetime.fromisoformat(scheduled).timestamp() if scheduled else None,
        "epoch": headers.get("clockwork_beat_epoch"),
        "run_now": headers.get("clockwork_beat_run_now"),
        "start": started,
        "end": time.time(),
        "pid": os.getpid(),
        **extra,
    }
    with open(journal, "a") as out:
        out.write(json.dumps(line) + "\n")
