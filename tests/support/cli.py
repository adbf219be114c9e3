"""Run ``ctl`` (``python -m control.cli``) from a test, without the caller's broker variable."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.support.workers import ROOT


def run_ctl(*args: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    """The finished process and how long it took."""
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "control.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        cwd=ROOT,
    )
    return proc, time.monotonic() - started
