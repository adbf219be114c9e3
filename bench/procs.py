"""Worker processes seen from ``/proc``: their tree, its memory, and stopping it (stdlib only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Memory:
    """Memory of a process tree in MiB: RSS counts shared pages once per process, PSS splits them."""

    rss_mib: float
    pss_mib: float
    processes: int


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent, ..."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: the fields after the last ')' are safe.
    return stat.rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int | None:
    """The parent of ``pid`` (None once it is gone)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (0 once it is gone)."""
    fields = _stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now (forkserver and pool children included)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            parent = parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def memory(pids: list[int]) -> Memory:
    """Sum ``Rss`` and ``Pss`` of ``smaps_rollup`` over ``pids`` (processes gone meanwhile count 0)."""
    rss_kib = pss_kib = alive = 0
    for pid in pids:
        try:
            text = (_PROC / str(pid) / "smaps_rollup").read_text()
        except OSError:
            continue
        alive += 1
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key == "Rss":
                rss_kib += int(rest.split()[0])
            elif key == "Pss":
                pss_kib += int(rest.split()[0])
    return Memory(round(rss_kib / 1024, 1), round(pss_kib / 1024, 1), alive)


def stop(proc: subprocess.Popen[bytes], *, timeout_s: float = 30.0) -> None:
    """SIGTERM the worker and wait; then SIGKILL whatever is left of its tree.

    A worker that does not stop in time is killed with its children, so no measurement leaves
    processes behind for the next one to compete with.
    """
    pids = tree(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    # Children that outlived their parent (or the parent itself) get SIGKILL, by their own pid.
    deadline = time.monotonic() + 5.0
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@contextmanager
def running(cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Run a worker with its output in a temporary log; stop it on exit, and print the log's tail
    to stderr if the block failed (so a peer's start-up error is seen, not just a timeout)."""
    fd, name = tempfile.mkstemp(prefix="bench-worker-", suffix=".log")
    log = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd)
        try:
            yield proc
        except BaseException:
            tail = log.read_bytes()[-3000:].decode(errors="replace")
            print(f"--- {cmd[:4]} output (tail) ---\n{tail}", file=sys.stderr, flush=True)
            raise
        finally:
            stop(proc)
    finally:
        log.unlink(missing_ok=True)
