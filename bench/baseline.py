"""A checkout of an earlier commit, so one run can put our code before and after a change side by side.

The baseline runs from a git worktree in ``.bench-baseline/<commit>`` with the project's venv (the
same pika, aio-pika and Python), so only our code differs between the two columns.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / ".bench-baseline"

__all__ = ["checkout"]


def checkout(rev: str) -> tuple[Path, str]:
    """A worktree of ``rev`` (made on first use); returns its path and the full commit id.

    Raises:
        subprocess.CalledProcessError: ``rev`` names no commit, or git could not add the worktree.
    """
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    path = BASELINES / commit[:12]
    if not (path / "bench" / "ours.py").exists():
        _git("worktree", "prune")
        print(f"bench: checking out the baseline {commit[:12]} into {path}", file=sys.stderr, flush=True)
        _git("worktree", "add", "--force", "--detach", str(path), commit)
    return path, commit


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip()
