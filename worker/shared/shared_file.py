"""A small file in shared memory that a worker and its consuming children map and lock.

The worker creates it (zeroed, in ``/dev/shm`` where there is one) and removes it on close; each
child attaches by path. Writers that must not interleave hold an advisory file lock, which the
kernel drops with a process that dies holding it.

A worker killed outright (SIGKILL, the OOM killer) cannot remove its files, and ``/dev/shm`` is
memory: each file's name carries its worker's pid, and a worker starting on the machine removes
those of workers that are gone (``sweep_stale``).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["SharedFile", "pid_alive", "shared_folder", "sweep_stale"]

# ``clockwork-<kind>-<pid of the worker that made it>-<random>``
_OWNED: Final = re.compile(r"clockwork-[a-z]+-(\d+)-")


def shared_folder() -> str:
    """Where the files go: ``/dev/shm`` (memory) where there is one, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def sweep_stale(folder: str | None = None) -> list[Path]:
    """Remove the shared files of workers that are gone (killed before they could); the removed."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(folder or shared_folder()) as entries:
        for entry in entries:
            owned = _OWNED.match(entry.name)
            if owned is not None and not pid_alive(int(owned[1])):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    # A zombie has exited (its connections are closed); only its exit status is left to read.
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split(maxsplit=1)[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in (b"Z", b"X")


class SharedFile:
    """``path`` mapped whole (``map``), with ``locked()`` and ``close()``.

    Args:
        path: the file.
        owner: remove the file on ``close`` (the worker's copy).

    Raises:
        ValueError: the file is empty.
    """

    def __init__(self, path: Path, *, owner: bool) -> None:
        self.path = path
        self._owner = owner
        self._fd = os.open(path, os.O_RDWR)
        self.size = os.fstat(self._fd).st_size
        if not self.size:
            os.close(self._fd)
            raise ValueError(f"{path} is empty")
        self.map = mmap.mmap(self._fd, self.size)

    @staticmethod
    def create(prefix: str, size: int) -> Path:
        """A new zeroed file of ``size`` bytes; its path (for the owner's ``SharedFile``)."""
        fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=shared_folder())
        with os.fdopen(fd, "wb") as file:
            file.truncate(size)
        return Path(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the file's exclusive lock (every process of the worker takes the same one)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unmap; the owner also removes the file."""
        with contextlib.suppress(ValueError, BufferError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
