"""A worker's processes as /proc shows them: its main process, the pool's forkserver, the children.

A fault that hits "the worker" hits all of them, as on a frozen machine or a container the OOM
killer ends: the children hold their own connections and deliveries, so signalling the main
process alone would leave them running.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["descendants", "signal_tree", "worker_main_pid"]


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command may hold spaces and parentheses


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), ())):
            found.append(child)
            todo.append(child)
    return found


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and every process under it, top down; returns the pids signalled.

    Top down, so a stopped or killed parent starts no new child meanwhile. The tree is listed
    first: once the main process is gone its children belong to init and are no longer found.
    """
    tree = [pid, *descendants(pid)]
    for each in tree:
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass  # it ended meanwhile
    return tree


def worker_main_pid() -> int:
    """From inside a pool child (or its thread): the pid of its worker's main process.

    The nearest ancestor started as ``python -m worker``: a child's parent is the pool's
    forkserver, not the worker.

    Raises:
        LookupError: no ancestor is a worker.
    """
    pid: int | None = os.getppid()
    while pid is not None and pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            break
        if any(a == b"-m" and b == b"worker" for a, b in zip(argv, argv[1:], strict=False)):
            return pid
        pid = _parent(pid)
    raise LookupError(f"process {os.getpid()} does not run under a worker")
