"""``Spool``: a producer's disk spool (``Settings.spool_dir``), between ``delay()`` and the broker.

With a spool a call returns once its task is in the spool, whatever the broker is doing: down,
blocked by an alarm, failing over. Opening takes a slot under ``spool_dir`` (``slots.py``) and
replays what a crashed predecessor left in it; then two threads run: the drain (``drain.py``),
which publishes in order with confirms, and the flusher, which writes the buffer on the time
trigger, deletes settled segments, and logs the backlog while there is one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from broker_svc.connection.io_thread import BrokerConnection
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import PublishError
from broker_svc.logging import get_logger
from broker_svc.settings import Settings
from broker_svc.spool.drain import SpoolDrain
from broker_svc.spool.slots import claim_slot
from broker_svc.spool.stats import SpoolStats
from broker_svc.spool.store import SpoolStore

__all__ = ["Spool"]

log = get_logger(__name__)

_DRAIN_WINDOW: Final = 10_000  # unconfirmed tasks the drain keeps in flight at most
_BACKLOG_AGE_S: Final = 1.0  # the oldest task waited this long: the broker is not keeping up
_BACKLOG_LOG_EVERY_S: Final = 10.0
_DOWN_GRACE_S: Final = 1.0  # close() waits no longer than this for a broker that is down


class Spool:
    """A producer's spool: opened on the app's first send, closed with the app.

    Args:
        settings: the ``spool_*`` settings (``spool_dir`` set).
        connection: the app's connection, which the drain publishes through.
        name: for threads and logs.

    Raises:
        SpoolError: ``spool_dir`` cannot be used, or all its slots are held by live processes.
    """

    def __init__(self, settings: Settings, connection: BrokerConnection, *, name: str) -> None:
        assert settings.spool_dir is not None
        self._settings = settings
        self._connection = connection
        self._slot = claim_slot(Path(settings.spool_dir).expanduser())
        try:
            self._store = SpoolStore(self._slot.path, settings)
            self._store.open()
        except BaseException:
            self._slot.release()
            raise
        window = min(settings.max_unconfirmed, _DRAIN_WINDOW)
        self._drain = SpoolDrain(self._store, connection, window=window, name=name)
        self._stopping = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_loop, name=f"clockwork-spool-flush-{name}", daemon=True
        )
        self._backlog_since: float | None = None
        self._backlog_logged = 0.0
        self._backlog_peak = 0
        self._closed = False
        log.info("spool_opened", directory=str(self._slot.path))
        self._drain.start()
        self._flusher.start()

    @property
    def directory(self) -> Path:
        """The slot directory this process holds."""
        return self._slot.path

    def append(self, items: Sequence[PendingPublish]) -> None:
        """Accept prepared publishes; each caller's handle settles once the broker confirms it.

        Raises:
            SpoolFull: the spool is full, or its disk; none of them was accepted.
            SpoolError: the spool cannot be written; none of them was accepted.
        """
        self._store.append(items)
        self._drain.wake()

    def persist(self) -> None:
        """Write what is buffered now (a batch's end), instead of at the next trigger."""
        self._store.write()

    def flush(self, timeout: float | None) -> None:
        """Wait until every task accepted so far is confirmed (or failed for good).

        Raises:
            PublishError: some are still in the spool after ``timeout``; they stay there and are
                published when the broker takes them.
        """
        target = self._store.next_seq
        if not self._store.wait_low(target, timeout):
            left = self.stats().depth
            raise PublishError(
                f"{left} task(s) still in the spool after {timeout} s; they stay there and are "
                "published when the broker takes them"
            )

    def stats(self) -> SpoolStats:
        """The spool's figures now."""
        figures = self._store.figures()
        drain = self._drain
        times = [t for t in (figures.oldest_at, drain.oldest_inflight_at) if t is not None]
        oldest = min(times, default=None)
        return SpoolStats(
            directory=str(self._slot.path),
            depth=figures.unsent + drain.held,
            bytes=figures.bytes,
            oldest_age_s=None if oldest is None else max(0.0, time.time() - oldest),
            buffered=figures.buffered,
            segments=figures.segments,
            accepted=figures.accepted,
            written=figures.written,
            fsyncs=figures.fsyncs,
            published=drain.published,
            failed=drain.failed,
            refused=figures.refused,
            replayed=self._drain.replayed,
            resent=drain.resent,
            can_publish=self._connection.can_publish,
            write_error=figures.write_error,
        )

    def close(self, timeout: float) -> None:
        """Give the drain up to ``timeout`` (less if the broker is down), then stop; what is not
        confirmed is written and stays in the slot for the next process."""
        if self._closed:
            return
        self._closed = True
        started = time.monotonic()
        target = self._store.next_seq
        while time.monotonic() - started < timeout and not self._store.wait_low(target, 0.1):
            if not self._connection.can_publish and time.monotonic() - started > _DOWN_GRACE_S:
                break  # the broker is down: the tasks are safe in the spool, do not hold the caller up
        self._drain.stop(timeout=5.0)
        self._stopping.set()
        self._flusher.join(timeout=5.0)
        try:
            self._store.close()
        finally:
            stats = self.stats()
            if stats.buffered:  # the disk is still full and the broker did not take them: gone
                log.error("spool_tasks_lost_at_close", tasks=stats.buffered, error=stats.write_error)
            if stats.depth:
                log.warning("spool_closed_with_backlog", directory=str(self._slot.path), tasks=stats.depth)
            self._slot.release()

    # -- the flusher's thread --------------------------------------------------------------------

    def _flush_loop(self) -> None:
        interval = self._settings.spool_flush_interval_s
        while not self._stopping.wait(interval):
            try:
                self._store.write()  # the time trigger; a failure is logged and retried next time
                self._store.collect()
                self._report()
            except Exception:  # the flusher must outlive any one bad tick
                log.exception("spool_flusher_error")

    def _report(self) -> None:
        # Depth and age in the logs while the broker is not keeping up, and once it caught up.
        stats = self.stats()
        now = time.monotonic()
        behind = stats.depth > 0 and (stats.oldest_age_s or 0.0) >= _BACKLOG_AGE_S
        if behind:
            self._backlog_peak = max(self._backlog_peak, stats.depth)
            if self._backlog_since is None:
                self._backlog_since = now
            if now - self._backlog_logged >= _BACKLOG_LOG_EVERY_S:
                self._backlog_logged = now
                log.warning(
                    "spool_backlog", directory=stats.directory, depth=stats.depth, bytes=stats.bytes,
                    oldest_age_s=round(stats.oldest_age_s or 0.0, 1), can_publish=stats.can_publish,
                )  # fmt: skip
        elif stats.depth == 0 and self._backlog_since is not None:
            log.warning(
                "spool_drained", directory=stats.directory, peak_depth=self._backlog_peak,
                took_s=round(now - self._backlog_since, 1),
            )  # fmt: skip
            self._backlog_since, self._backlog_logged, self._backlog_peak = None, 0.0, 0
