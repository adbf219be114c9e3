"""Taking over a slot after a predecessor: its settled mark (``low``) and its segment files.

``low`` is the number below which every task of the slot is settled. The drain saves it each
flusher tick (written to a temporary file and renamed, without fsync: a stale or lost value only
makes a successor send again tasks the broker already has). A successor reads it, then finds
what is above it in the segment files, in two steps: ``last_number`` reads only the last segment
(in the first send, which must stay fast) and ``index`` reads the rest (on the drain's thread).
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Final

from broker_svc.logging import get_logger
from broker_svc.spool.segment import Segment, recover

__all__ = ["index", "last_number", "read_low", "save_low", "size_of"]

log = get_logger(__name__)

_LOW_FILE: Final = "low"
_LOW: Final = struct.Struct("<QI")  # the number, CRC-32 of its 8 bytes


def read_low(directory: Path) -> int:
    """The slot's saved ``low``; 0 when there is none or it does not check out."""
    try:
        raw = (directory / _LOW_FILE).read_bytes()
        low, crc = _LOW.unpack(raw)
    except (OSError, struct.error):
        return 0
    return int(low) if zlib.crc32(raw[:8]) == crc else 0


def save_low(directory: Path, low: int) -> bool:
    """Save ``low``; False (logged) if it could not be written, a full disk say."""
    temporary = directory / f"{_LOW_FILE}.tmp"
    try:
        temporary.write_bytes(_LOW.pack(low, zlib.crc32(struct.pack("<Q", low))))
        os.replace(temporary, directory / _LOW_FILE)
    except OSError as exc:
        log.warning("spool_low_not_saved", directory=str(directory), error=str(exc))
        return False
    return True


def last_number(paths: list[Path]) -> int:
    """The number of the last whole record in ``paths`` (oldest first), or -1.

    The last segment is cut to its last whole record on the way: a crash can cut only that one.
    """
    for path in reversed(paths):
        found = recover(path)
        if found is not None:
            return found[0].last_seq
    return -1


def index(paths: list[Path], low: int) -> tuple[list[Segment], int]:
    """The segments holding tasks numbered ``low`` or more, and how many such tasks there are.

    Segments holding none are deleted.
    """
    segments: list[Segment] = []
    pending = 0
    for path in paths:
        found = recover(path, count_from=low)
        if found is None:
            continue
        segment, count = found
        if count == 0:
            path.unlink(missing_ok=True)
            continue
        segments.append(segment)
        pending += count
    return segments, pending


def size_of(path: Path) -> int:
    """A file's size, 0 if it is gone."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
