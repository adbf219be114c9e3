"""Shared-memory files: named after their worker's pid, swept once that worker is gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from worker.shared.shared_file import SharedFile, pid_alive, sweep_stale


def _dead_pid() -> int:
    # A process that has exited and been reaped: its pid is free (and not reused this soon).
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_a_file_carries_its_workers_pid_and_is_removed_by_its_owner():
    path = SharedFile.create("clockwork-test-", 64)
    assert path.name.startswith(f"clockwork-test-{os.getpid()}-")
    shared = SharedFile(path, owner=True)
    with shared.locked():
        shared.map[:4] = b"abcd"
    assert SharedFile(path, owner=False).map[:4] == b"abcd"
    shared.close()
    assert not path.exists()


def test_the_sweep_removes_only_files_of_workers_that_are_gone(tmp_path: Path):
    dead = _dead_pid()
    assert not pid_alive(dead) and pid_alive(os.getpid())
    gone = tmp_path / f"clockwork-board-{dead}-x1"
    mine = tmp_path / f"clockwork-rates-{os.getpid()}-x2"
    unnamed = tmp_path / "clockwork-board-x3"  # an older worker's name: no pid, left alone
    other = tmp_path / f"postgres-{dead}-x4"
    for path in (gone, mine, unnamed, other):
        path.write_bytes(b"\0" * 8)
    assert sweep_stale(str(tmp_path)) == [gone]
    assert not gone.exists() and mine.exists() and unnamed.exists() and other.exists()
    assert sweep_stale(str(tmp_path / "missing")) == []  # no such folder: nothing to do
