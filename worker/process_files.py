"""The worker process's files: ``--pidfile`` and ``--logfile``, as Celery's worker options of those names."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path

from broker_svc.errors import ConfigurationError

__all__ = ["redirect_output", "write_pidfile"]


def write_pidfile(path: Path) -> None:
    """Write this process's pid to ``path``, removed again at exit.

    A file left by a worker that is gone (a crash, a kill -9) is replaced; one whose process still
    runs stops this start, so two workers are never run from one pidfile.

    Raises:
        ConfigurationError: the pid in ``path`` belongs to a running process, or it cannot be written.
    """
    other = 0
    with contextlib.suppress(FileNotFoundError, ValueError):  # none, or not a pid: replaced
        other = int(path.read_text().strip() or "0")
    if other > 0 and other != os.getpid() and _running(other):
        raise ConfigurationError(f"pidfile {path} names process {other}, which is running: is a worker up?")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(f"{os.getpid()}\n")
        temporary.replace(path)  # atomic: a reader never sees a half-written pid
    except OSError as exc:
        raise ConfigurationError(f"cannot write pidfile {path}: {exc}") from None
    pid = os.getpid()

    def remove() -> None:
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text().strip()) == pid:  # never remove a successor's file
                path.unlink()

    atexit.register(remove)


def redirect_output(path: Path) -> None:
    """Send this process's stdout and stderr, and its pool children's, to ``path`` (appended).

    At the file-descriptor level, so a task's ``print``, a traceback and a child's log lines all land
    there; call it before the pool starts, as children inherit the descriptors.

    Raises:
        ConfigurationError: the file cannot be opened.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise ConfigurationError(f"cannot open logfile {path}: {exc}") from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: running
    return True
