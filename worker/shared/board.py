"""What each consuming child runs now, in shared memory: the worker reads it without asking anyone.

No message crosses from a child to the worker per task, yet
``inspect active``, ``query_task``, ``revoke --terminate`` and the heartbeat's active count need to
know what runs where. Each child owns one slot of a memory-mapped file and writes the task it
starts and clears it when the task ends; the worker reads the slots when asked.

A slot is ``seq`` (even: stable, odd: being written), the child's pid, the start time, a msgpack
map of the task (id, name, args, kwargs, delivery_info) and how many tasks the child has ended. A
reader retries while ``seq`` is odd or changed under it, so it never sees half a write and the
writer never waits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgpack

from broker_svc.errors import DecodeError
from broker_svc.wire.codec import refuse_ext
from broker_svc.wire.task.stamps import task_stamps
from broker_svc.wire.task.task_message import safe_repr
from worker.ipc import Job
from worker.shared.shared_file import SharedFile

__all__ = ["Board", "BoardSlot", "Running"]

SLOT_SIZE: Final = 8192
_HEAD = struct.Struct("<IIdIQ")  # seq, pid, started (epoch s), payload length, tasks ended
_SEQ = struct.Struct("<I")
_MAX_PAYLOAD: Final = SLOT_SIZE - _HEAD.size
_READ_TRIES: Final = 100


@dataclass(frozen=True, slots=True)
class Running:
    """One task running in a consuming child, as the board shows it."""

    slot: int
    pid: int
    started: float
    info: dict[str, Any]


class Board:
    """A file of ``slots`` slots, mapped into the worker and each consuming child.

    Create it in the worker (``Board.create``) and attach each child to its slot by path
    (``Board.attach``); the worker removes the file on ``close``.
    """

    def __init__(self, path: Path, slots: int, *, owner: bool) -> None:
        self.path = path
        self.slots = slots
        self._owner = owner
        self._ended = 0  # a child's count of its tasks that ended
        self._pid = os.getpid()  # the child's, once attached (a system call per read otherwise)
        with path.open("r+b") as file:
            self._map = mmap.mmap(file.fileno(), slots * SLOT_SIZE)

    @classmethod
    def create(cls, slots: int) -> Board:
        """A zeroed board in shared memory (``/dev/shm`` where there is one)."""
        return cls(SharedFile.create("clockwork-board-", slots * SLOT_SIZE), slots, owner=True)

    @classmethod
    def attach(cls, path: str, slots: int) -> Board:
        """The worker's board, in a child."""
        return cls(Path(path), slots, owner=False)

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` slots (the worker's side; a no-op when there is room already).

        The pool grows past its start-up size (``pool_grow``, the autoscaler), and a retiring child
        keeps its slot until it exits, so the slots alive at once are not known up front. The file
        grows (zero-filled) and the worker maps it anew; children attached before keep their
        shorter map, which still holds their own slot.

        Raises:
            RuntimeError: called in a child, which only attaches.
        """
        if not self._owner:
            raise RuntimeError("only the worker's board grows")
        if slots <= self.slots or self._map.closed:
            return
        os.truncate(self.path, slots * SLOT_SIZE)
        with self.path.open("r+b") as file:
            grown = mmap.mmap(file.fileno(), slots * SLOT_SIZE)
        old, self._map, self.slots = self._map, grown, slots
        old.close()

    # -- a child's slot --------------------------------------------------------------------------

    def start(self, slot: int, info: dict[str, Any]) -> None:
        """Show ``info`` (a task's id, name, args, kwargs, delivery_info) as running in ``slot``."""
        payload = msgpack.packb(info, default=repr)
        if len(payload) > _MAX_PAYLOAD:  # big arguments: their reprs, cut short
            small = {
                **info,
                "args": safe_repr(info.get("args"))[:1000],
                "kwargs": safe_repr(info.get("kwargs"))[:1000],
            }
            payload = msgpack.packb(small, default=repr)[:_MAX_PAYLOAD]
        self._write(slot, self._pid, time.time(), payload)

    def end(self, slot: int) -> None:
        """Nothing runs in ``slot`` any more: one more task ended there."""
        self._ended += 1
        self._write(slot, self._pid, 0.0, b"")

    def _write(self, slot: int, pid: int, started: float, payload: bytes) -> None:
        base = slot * SLOT_SIZE
        (seq,) = _SEQ.unpack_from(self._map, base)
        _SEQ.pack_into(self._map, base, (seq + 1) & 0xFFFFFFFF)  # odd: being written
        _HEAD.pack_into(self._map, base, (seq + 1) & 0xFFFFFFFF, pid, started, len(payload), self._ended)
        self._map[base + _HEAD.size : base + _HEAD.size + len(payload)] = payload
        _SEQ.pack_into(self._map, base, (seq + 2) & 0xFFFFFFFF)

    # -- the worker's view -----------------------------------------------------------------------

    def running(self) -> list[Running]:
        """Every task running now, slot by slot (none once closed)."""
        if self._map.closed:
            return []
        found = []
        for slot in range(self.slots):
            entry = self._read(slot)
            if entry is not None:
                found.append(entry)
        return found

    def _read(self, slot: int) -> Running | None:
        base = slot * SLOT_SIZE
        for _ in range(_READ_TRIES):
            seq, pid, started, length, _ended = _HEAD.unpack_from(self._map, base)
            if seq & 1:
                continue
            payload = bytes(self._map[base + _HEAD.size : base + _HEAD.size + min(length, _MAX_PAYLOAD)])
            if _SEQ.unpack_from(self._map, base)[0] != seq:
                continue
            if not length:
                return None
            try:
                info = msgpack.unpackb(payload, strict_map_key=False, ext_hook=refuse_ext)
            except (ValueError, msgpack.ExtraData, DecodeError):  # cut short to fit: say no more
                info = {}
            return Running(slot, pid, started, info if isinstance(info, dict) else {})
        return None

    def ended(self, slot: int) -> int:
        """How many tasks the child in ``slot`` has ended (0 once closed)."""
        if self._map.closed:
            return 0
        return int(_HEAD.unpack_from(self._map, slot * SLOT_SIZE)[4])

    def clear(self, slot: int) -> None:
        """Empty a slot whose child died mid-task (the worker's side)."""
        self._write(slot, 0, 0.0, b"")

    def close(self) -> None:
        """Unmap; the worker also removes the file."""
        with contextlib.suppress(ValueError, BufferError):
            self._map.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class BoardSlot:
    """A consumer's slot on the board: a task shows there, with its hard limit
    (``worker/pool/hard_limits.py``), from its run's start until settled, so a copy sent back
    meanwhile finds it (``worker/child/redeliveries.py``)."""

    def __init__(self, board: Board | None, slot: int) -> None:
        self._board, self._slot = board, slot
        self._showing = False

    def start(self, job: Job) -> None:
        if self._board is not None:
            info = {"id": job.task_id, "name": job.task_name, "type": job.task_name, "args": job.args,
                    "kwargs": job.kwargs, "delivery_info": job.request.get("delivery_info"),
                    "time_limit": job.hard_time_limit_s}  # fmt: skip
            stamps = task_stamps(job.request.get("stamped_headers"), job.request.get("stamps"))
            if stamps:  # a revoke by stamps with terminate finds it by them
                info["stamps"] = stamps
            self._board.start(self._slot, info)
            self._showing = True

    def end(self) -> None:
        if self._showing and self._board is not None:
            self._board.end(self._slot)
            self._showing = False
