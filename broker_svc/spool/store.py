"""The spool's state: a bounded memory buffer in front of append-only segment files.

Every accepted task gets the next number and waits in the buffer until a trigger writes it: the
count trigger (``spool_flush_count`` waiting, written by the call that reaches it) or the time
trigger (the spool's flusher, every ``spool_flush_interval_s``). The drain takes tasks in number
order: from memory while it keeps up, else read back from the segment files. A task confirmed
before its trigger is never written. The drain reports ``low``, the number below which every task
is settled; segments wholly below it are deleted, and ``low`` is saved (without fsync: a stale
value only replays settled tasks again) so a successor skips what is settled.

With ``spool_flush_count=1`` (write-through) a task reaches the drain only once written, so a call
that cannot write its task raises and the task is not accepted.
"""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import SpoolError, SpoolFull
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.spool.disk_reader import DiskReader
from broker_svc.spool.entry import Entry, spooled_of
from broker_svc.spool.record import HEADER, encode_payload, frame
from broker_svc.spool.segment import SEGMENT_BYTES, Segment, SegmentWriter, segment_paths
from broker_svc.spool.takeover import index, last_number, read_low, save_low, size_of

__all__ = ["SpoolStore", "StoreFigures"]

log = get_logger(__name__)

_DISK_FULL: Final = (errno.ENOSPC, errno.EDQUOT)
# A fully settled segment still being appended to is closed and deleted once this old.
_IDLE_SEGMENT_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class StoreFigures:
    """The store's counts at one moment (``oldest_at``: epoch seconds of the oldest not taken)."""

    accepted: int
    buffered: int
    bytes: int
    fsyncs: int
    oldest_at: float | None
    refused: int
    segments: int
    unsent: int
    write_error: str | None
    written: int


class SpoolStore:
    """Accepted tasks, in memory and in the segment files of one slot directory (thread-safe)."""

    def __init__(self, directory: Path, settings: Settings) -> None:
        self._dir = directory
        self._fsync = settings.spool_fsync
        self._max_bytes = settings.spool_max_bytes
        self._flush_count = settings.spool_flush_count
        self._memory_records = settings.spool_memory_records
        self._write_through = settings.spool_flush_count == 1
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._write_lock = threading.Lock()  # one writer of the files at a time
        self._segments: list[Segment] = []  # oldest first; the last may be the writer's
        self._writer: SegmentWriter | None = None
        self._writer_since = 0.0
        self._buffer: list[Entry] = []  # accepted, not written yet
        self._buffer_bytes = 0
        self._disk_bytes = 0
        self._unsent: collections.deque[Entry] = collections.deque()  # in memory, not taken yet
        self._unsent_count = 0  # not taken yet, in memory or only on disk
        self._handles: dict[int, weakref.ref[PendingPublish]] = {}  # of tasks only on disk
        self._next_seq = 0
        self._send_next = 0
        self._low = 0
        self._saved_low = -1
        self._reader = DiskReader(settings=settings)
        self._write_error: OSError | None = None
        self._inherited: list[Path] = []  # a predecessor's segments, until recover() indexed them
        self._inherited_bytes = 0
        self.replay_below = 0  # tasks numbered below were spooled by a predecessor
        self.accepted = self.written = self.fsyncs = self.refused = 0

    # -- opening ---------------------------------------------------------------------------------

    def open(self) -> None:
        """Take over the slot, quickly: new tasks are numbered after a predecessor's
        (``takeover.last_number`` reads only the last segment); ``recover`` reads the rest."""
        low = read_low(self._dir)
        self._send_next = self._low = self._saved_low = low
        self._inherited = segment_paths(self._dir)
        self._inherited_bytes = sum(size_of(path) for path in self._inherited)
        self._disk_bytes = self._inherited_bytes  # counted against spool_max_bytes from the start
        self._next_seq = self.replay_below = max(low, last_number(self._inherited) + 1)

    def recover(self) -> int:
        """Index and count what a predecessor left above ``low``: the number of tasks to replay.

        Called once, by the drain before it takes anything, so they go out before new tasks.
        """
        segments, pending = index(self._inherited, self._low)
        with self._lock:
            self._segments[:0] = segments  # before any this process wrote
            self._disk_bytes += sum(s.size for s in segments) - self._inherited_bytes
            self._unsent_count += pending
        self._inherited, self._inherited_bytes = [], 0
        return pending

    # -- callers ---------------------------------------------------------------------------------

    def append(self, items: Sequence[PendingPublish]) -> None:
        """Accept prepared publishes, in order; on return each is in the spool.

        Raises:
            SpoolFull: over ``spool_max_bytes``, or the disk is full; none of ``items`` is accepted.
            SpoolError: the spool cannot be written (or is closed); none of them is accepted.
            TypeError: a header value cannot be spooled; none of them is accepted.
        """
        payloads = [encode_payload(spooled_of(pending)) for pending in items]
        size = sum(map(len, payloads)) + HEADER.size * len(payloads)
        now = time.time()
        with self._lock:
            self._check_accepting(size, len(items))
            entries = []
            for pending, payload in zip(items, payloads, strict=True):
                seq = self._next_seq
                self._next_seq = seq + 1
                entries.append(Entry(seq, now, pending, data=frame(seq, now, payload), handle=pending))
            self._buffer.extend(entries)
            self._buffer_bytes += size
            self.accepted += len(entries)
            if not self._write_through:
                self._unsent.extend(entries)
                self._unsent_count += len(entries)
                self._drop_written()
            due = len(self._buffer) >= self._flush_count
        if due:
            error = self.write(own=entries if self._write_through else None)
            if error is not None and self._write_through:
                raise self._refusal(error)

    def _check_accepting(self, size: int, count: int) -> None:
        if os.getpid() != self._pid:
            raise SpoolError(
                f"this spool belongs to process {self._pid}; create the App after forking, not before"
            )
        if self._write_error is not None and not self._write_through:
            if any(not entry.settled for entry in self._buffer):
                self.refused += count  # accepted tasks wait in memory for the disk: take no more
                raise self._refusal(self._write_error)
            self._write_error = None  # the broker took them all; the next write tells about the disk
        held = self._disk_bytes + self._buffer_bytes
        if held + size > self._max_bytes:
            self.refused += count
            raise SpoolFull(
                f"the spool holds {held} bytes of spool_max_bytes={self._max_bytes} "
                f"({self._unsent_count} tasks not yet published): the task was not accepted"
            )

    def _refusal(self, error: OSError) -> SpoolError:
        if error.errno in _DISK_FULL:
            return SpoolFull(f"the spool's disk is full ({error}): the task was not accepted")
        return SpoolError(f"the spool cannot be written ({error}): the task was not accepted")

    def _drop_written(self) -> None:
        # The memory bound: tasks already written leave memory; the drain reads them back.
        unsent = self._unsent
        while len(unsent) > self._memory_records and unsent[0].written:
            entry = unsent.popleft()
            if entry.handle is not None:
                self._handles[entry.seq] = weakref.ref(entry.handle, self._forget(entry.seq))

    def _forget(self, seq: int) -> Callable[[weakref.ref[PendingPublish]], None]:
        def forget(_ref: weakref.ref[PendingPublish]) -> None:
            self._handles.pop(seq, None)  # the caller dropped its result

        return forget

    # -- writing ---------------------------------------------------------------------------------

    def write(self, *, own: Sequence[Entry] | None = None) -> OSError | None:
        """Write what the buffer holds (and fsync per the policy); the error if that failed.

        On failure nothing is lost: the tasks stay in the buffer for the next trigger, and
        ``own`` (write-through: the calling tasks) are taken out of the spool again.
        """
        with self._write_lock:
            with self._lock:
                batch, self._buffer = self._buffer, []
                batch_bytes = sum(len(entry.data or b"") for entry in batch)
                self._buffer_bytes -= batch_bytes
            todo = [entry for entry in batch if not entry.settled]  # confirmed already: no need
            data = b"".join(entry.data or b"" for entry in todo)
            error: OSError | None = None
            appended = not todo
            if todo:
                try:
                    writer = self._active_writer(todo[0])
                    writer.append(data, last_seq=todo[-1].seq)
                    appended = True
                    if self._fsync:
                        writer.sync()
                        self.fsyncs += 1
                except OSError as exc:
                    error = exc
            with self._lock:
                if not appended:
                    assert error is not None
                    self._put_back(batch, batch_bytes, own)
                    self._write_error = error
                    log.error("spool_write_failed", directory=str(self._dir), error=str(error))
                    return error
                if error is not None:  # in the file, but fsync failed: not known to be durable
                    log.error("spool_fsync_failed", directory=str(self._dir), error=str(error))
                for entry in todo:
                    entry.written = True
                for entry in batch:
                    entry.data = None
                self._disk_bytes += len(data)
                self.written += len(todo)
                self._write_error = None
                if self._write_through:
                    self._unsent.extend(todo)
                    self._unsent_count += len(todo)
                self._drop_written()
            return None

    def _put_back(self, batch: list[Entry], batch_bytes: int, own: Sequence[Entry] | None) -> None:
        self._buffer[:0] = batch  # still first in line, in order
        self._buffer_bytes += batch_bytes
        if own:
            mine = {id(entry) for entry in own}
            self._buffer = [entry for entry in self._buffer if id(entry) not in mine]
            self._buffer_bytes -= sum(len(entry.data or b"") for entry in own)
            self.accepted -= len(own)

    def _active_writer(self, first: Entry) -> SegmentWriter:
        writer = self._writer
        if writer is not None and writer.segment.size >= SEGMENT_BYTES:
            writer.close()  # sealed; deleted once settled
            writer = self._writer = None
        if writer is None:
            writer = SegmentWriter.create(self._dir, first.seq, first.at, fsync=self._fsync)
            with self._lock:
                self._segments.append(writer.segment)
                self._disk_bytes += writer.segment.size
            self._writer = writer
            self._writer_since = time.monotonic()
        return writer

    # -- the drain -------------------------------------------------------------------------------

    def take(self, limit: int) -> list[Entry]:
        """Up to ``limit`` tasks not taken yet, in number order (the drain's thread only)."""
        with self._lock:
            on_disk_only = self._unsent_count - len(self._unsent)
            if on_disk_only <= 0:
                count = min(limit, len(self._unsent))
                taken = [self._unsent.popleft() for _ in range(count)]
                if taken:
                    self._send_next = taken[-1].seq + 1
                    self._unsent_count -= count
                return taken
            segments = [(s.path, s.last_seq, s.size) for s in self._segments]
            send_next = self._send_next
        # The tasks that left memory are the oldest not taken: read them back, outside the lock.
        records, decoded = self._reader.read(segments, send_next, min(limit, on_disk_only))
        with self._lock:
            if not records:
                log.error("spool_records_missing", directory=str(self._dir), count=on_disk_only)
                self._unsent_count = len(self._unsent)  # nothing more to find: do not spin on it
                return []
            self._send_next = records[-1].seq + 1
            self._unsent_count -= len(records)
            taken = []
            for record, template in zip(records, decoded, strict=True):
                if template is None:
                    continue  # unreadable: logged by the reader
                ref = self._handles.pop(record.seq, None)
                handle = ref() if ref is not None else None
                resend = record.seq < self.replay_below  # a predecessor may have sent it already
                entry = Entry(record.seq, record.at, template, handle=handle, written=True, resend=resend)
                taken.append(entry)
        if len(records) == on_disk_only and len(records) < limit:
            taken += self.take(limit - len(records))  # caught up with memory
        return taken

    def set_low(self, low: int) -> None:
        """Every task numbered below ``low`` is settled (the drain's word)."""
        with self._lock:
            if low > self._low:
                self._low = low
                self._settled.notify_all()

    @property
    def directory(self) -> Path:
        """The slot directory."""
        return self._dir

    @property
    def next_seq(self) -> int:
        """The number the next accepted task gets."""
        return self._next_seq

    @property
    def send_next(self) -> int:
        """The lowest number the drain has not taken yet."""
        return self._send_next

    def wait_low(self, target: int, timeout: float | None) -> bool:
        """Wait until every task numbered below ``target`` is settled."""
        with self._settled:
            return self._settled.wait_for(lambda: self._low >= target, timeout)

    # -- the flusher -----------------------------------------------------------------------------

    def collect(self, *, closing: bool = False) -> None:
        """Delete the segments whose tasks are all settled, and save ``low``."""
        with self._write_lock:
            with self._lock:
                low = self._low
                writer = self._writer
                if (
                    writer is not None
                    and writer.segment.last_seq < low
                    and (closing or time.monotonic() - self._writer_since > _IDLE_SEGMENT_S)
                ):
                    writer.close()
                    self._writer = None
                active = self._writer.segment if self._writer is not None else None
                done = [s for s in self._segments if s.last_seq < low and s is not active]
                for segment in done:
                    self._segments.remove(segment)
                    self._disk_bytes -= segment.size
            for segment in done:
                segment.path.unlink(missing_ok=True)
        if low != self._saved_low and save_low(self._dir, low):
            self._saved_low = low

    def figures(self) -> StoreFigures:
        """The counts now."""
        with self._lock:
            on_disk_only = self._unsent_count - len(self._unsent)
            oldest: float | None = None
            if on_disk_only > 0:
                first = next((s for s in self._segments if s.last_seq >= self._send_next), None)
                oldest = first.first_at if first is not None else None
            elif self._unsent:
                oldest = self._unsent[0].at
            return StoreFigures(
                accepted=self.accepted,
                buffered=sum(1 for entry in self._buffer if not entry.settled),
                bytes=self._disk_bytes + self._buffer_bytes,
                fsyncs=self.fsyncs,
                oldest_at=oldest,
                refused=self.refused,
                segments=len(self._segments),
                unsent=self._unsent_count,
                write_error=None if self._write_error is None else str(self._write_error),
                written=self.written,
            )

    def close(self) -> None:
        """Write what is buffered and close the files; the slot keeps what is unsettled."""
        self.write()
        self.collect(closing=True)
        with self._write_lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
