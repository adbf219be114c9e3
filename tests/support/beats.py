"""Start ``clockwork-beat`` processes for tests, and read what the scheduled tasks journaled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

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
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]


def new_journal(directory: Path) -> Path:
    return Path(tempfile.mkstemp(dir=directory, prefix="beat-runs-", suffix=".jsonl")[1])
