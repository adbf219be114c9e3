"""Spool segment files: append-only, a magic header then records; recovered after a crash.

A segment is written by one process at a time (its slot's lock), only ever appended to, and
deleted whole once every record in it is settled. A crash can leave its last record cut short (or,
on some file systems after a power loss, a tail of zeros): ``recover`` truncates the file to its
last whole record and says how much it dropped. Such a tail was never reported written to anyone
whose task depended on it (see the fsync policy in docs/guide.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from broker_svc.logging import get_logger
from broker_svc.spool.record import RawRecord, scan

__all__ = [
    "MAGIC",
    "SEGMENT_BYTES",
    "Segment",
    "SegmentWriter",
    "fsync_directory",
    "read_records",
    "recover",
    "segment_paths",
]

log = get_logger(__name__)

MAGIC: Final = b"CWSPOOL1"
# A segment is closed for appending past this size, so a settled one can be deleted soon.
SEGMENT_BYTES: Final = 4 * 1024 * 1024
_SUFFIX: Final = ".spool"


@dataclass(slots=True)
class Segment:
    """One segment file and what it holds (kept by the spool under its lock).

    Attributes:
        path: the file.
        first_seq: the number of its first record.
        last_seq: the number of its last whole record.
        first_at: when its first record was spooled (epoch seconds).
        size: its length in bytes up to the end of its last whole record.
    """

    path: Path
    first_seq: int
    last_seq: int
    first_at: float
    size: int


def segment_paths(directory: Path) -> list[Path]:
    """The segment files in ``directory``, oldest first (their names are their first numbers)."""
    return sorted(directory.glob(f"*{_SUFFIX}"))


def fsync_directory(directory: Path) -> None:
    """Make a file created or renamed in ``directory`` survive a machine crash."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentWriter:
    """The segment being appended to; one writer at a time (the spool's write lock)."""

    def __init__(self, segment: Segment, fd: int) -> None:
        self.segment = segment
        self._fd = fd

    @classmethod
    def create(cls, directory: Path, first_seq: int, first_at: float, *, fsync: bool) -> SegmentWriter:
        """A new, empty segment whose first record will be ``first_seq``.

        Raises:
            OSError: it cannot be created (a full disk: ENOSPC); nothing is left behind.
        """
        path = directory / f"{first_seq:020d}{_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, MAGIC)
            if fsync:
                os.fsync(fd)
                fsync_directory(directory)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(Segment(path, first_seq, first_seq - 1, first_at, len(MAGIC)), fd)

    def append(self, data: bytes, *, last_seq: int) -> None:
        """Append whole records ending with ``last_seq``; on failure the file is as before.

        Raises:
            OSError: the write failed (ENOSPC, EIO); a partial write was cut off again.
        """
        try:
            _write_all(self._fd, data)
        except OSError:
            try:
                os.ftruncate(self._fd, self.segment.size)  # no half record for a replay to meet
            except OSError:
                pass  # recover() truncates it on the next start
            raise
        self.segment.size += len(data)
        self.segment.last_seq = last_seq

    def sync(self) -> None:
        """fsync the segment.

        Raises:
            OSError: the disk failed to persist it.
        """
        os.fsync(self._fd)

    def close(self) -> None:
        """Close the file (its records stay)."""
        os.close(self._fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def recover(path: Path, *, count_from: int = 0) -> tuple[Segment, int] | None:
    """The segment at ``path`` after a crash, cut to its last whole record, and how many of its
    records are numbered ``count_from`` or more; None if it holds no record.

    A file with no record is removed; one that is not a segment is renamed ``*.corrupt`` and
    left for a person to look at. Never raises for what a crash can leave.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        log.error("spool_segment_unreadable", path=str(path), error=str(exc))
        return None
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):  # the crash came while the file was being created
            path.unlink(missing_ok=True)
        else:
            kept = path.with_suffix(".corrupt")
            path.rename(kept)
            log.error("spool_segment_not_a_segment", path=str(path), kept_as=str(kept))
        return None
    records, end = scan(data, len(MAGIC))
    if end < len(data):
        os.truncate(path, end)
        dropped = len(data) - end
        log.warning("spool_segment_truncated", path=str(path), dropped_bytes=dropped, kept=len(records))
    if not records:
        path.unlink(missing_ok=True)
        return None
    count = sum(1 for record in records if record.seq >= count_from)
    return Segment(path, records[0].seq, records[-1].seq, records[0].at, end), count


def read_records(path: Path, offset: int, end: int) -> tuple[list[RawRecord], int]:
    """The whole records in ``path`` between ``offset`` and ``end``, and where they stop."""
    with path.open("rb") as file:
        file.seek(offset)
        data = file.read(end - offset)
    records, stop = scan(data, 0)
    return records, offset + stop
