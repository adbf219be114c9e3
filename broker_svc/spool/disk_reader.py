"""Reading spooled tasks back from the segment files, for a drain that fell behind memory."""

from __future__ import annotations

import collections
from pathlib import Path

from broker_svc.connection.pending import PendingPublish
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.spool.entry import template_of
from broker_svc.spool.record import RawRecord, decode_payload
from broker_svc.spool.segment import MAGIC, read_records

__all__ = ["DiskReader"]

log = get_logger(__name__)


class DiskReader:
    """Where the drain is in the segment files: the file, the offset, the records read ahead.

    Used by one thread (the drain's). Segments only grow while it reads them, and only segments
    wholly below what it has taken are deleted, so it never needs one that is gone.
    """

    def __init__(self, *, settings: Settings | None = None) -> None:
        self._settings = settings  # how the replaying producer declares its task queues
        self._path: Path | None = None
        self._offset = 0
        self._ahead: collections.deque[RawRecord] = collections.deque()

    def read(
        self, segments: list[tuple[Path, int, int]], send_next: int, limit: int
    ) -> tuple[list[RawRecord], list[PendingPublish | None]]:
        """Up to ``limit`` records numbered ``send_next`` or more, in order, with their publishes.

        Args:
            segments: each segment's path, last record number and size, oldest first.
            send_next: the lowest number wanted.
            limit: the most records to return.

        A record that does not decode is returned with None (and logged), so it is passed over.
        """
        records: list[RawRecord] = []
        while len(records) < limit:
            if not self._ahead and not self._refill(segments, send_next):
                break
            record = self._ahead.popleft()
            if record.seq >= send_next:
                records.append(record)
                send_next = record.seq + 1
        return records, [self._decode(record) for record in records]

    def _refill(self, segments: list[tuple[Path, int, int]], send_next: int) -> bool:
        for path, last_seq, size in segments:
            if last_seq < send_next:
                continue
            offset = self._offset if path == self._path else len(MAGIC)
            if offset >= size:
                continue
            try:
                found, stop = read_records(path, offset, size)
            except OSError as exc:
                log.error("spool_segment_unreadable", path=str(path), error=str(exc))
                continue
            self._path, self._offset = path, stop
            self._ahead.extend(record for record in found if record.seq >= send_next)
            if self._ahead:
                return True
        return False

    def _decode(self, record: RawRecord) -> PendingPublish | None:
        try:
            return template_of(decode_payload(record.payload), settings=self._settings)
        except (ValueError, TypeError) as exc:
            log.error("spool_record_unreadable", seq=record.seq, error=str(exc))
            return None
