"""An app's way to the broker: its publisher and, with ``spool_dir`` set, the spool in front of it.

Without a spool a prepared task goes straight to the connection (``Publisher.submit``). With one,
it goes to the spool and the spool's drain publishes it, so a call never waits on the broker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker_svc.clock import LamportClock
from broker_svc.connection.channel import Consumer
from broker_svc.connection.pending import PendingPublish
from broker_svc.sending.publisher import Publisher
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec

if TYPE_CHECKING:
    from broker_svc.spool.spool import Spool
    from broker_svc.spool.stats import SpoolStats

__all__ = ["Producer"]


class Producer:
    """The publisher, and the spool when the settings ask for one.

    Raises:
        SpoolError: ``spool_dir`` is set and cannot be used (the connection is closed again).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: LamportClock,
        name: str,
        consumers: Sequence[tuple[QueueSpec, Consumer]] = (),
    ) -> None:
        self.publisher = Publisher(settings, clock=clock, name=name, consumers=consumers)
        self.spool: Spool | None = None
        if settings.spool_dir is not None:
            from broker_svc.spool.spool import Spool  # only apps with a spool load it

            try:
                self.spool = Spool(settings, self.publisher.connection, name=name)
            except BaseException:
                self.publisher.connection.close()
                raise
        self.publisher.connection.start()

    def submit(self, items: Sequence[PendingPublish], *, wait: bool = False) -> None:
        """Send prepared tasks: to the spool, or to the connection.

        ``wait``: without a spool, wait for every confirm (one wait for all); with one, write them
        to the spool file now (one write and fsync for all) rather than at the next trigger.

        Raises:
            SpoolFull, SpoolError: (spool) none of them was accepted.
            PublishError: (no spool, ``wait`` or ``confirm="each"``) one was not confirmed.
        """
        if self.spool is not None:
            self.spool.append(items)
            if wait:
                self.spool.persist()
            return
        self.publisher.submit(items, wait=wait or None)

    def spool_stats(self) -> SpoolStats | None:
        """The spool's figures, or None without a spool."""
        return self.spool.stats() if self.spool is not None else None

    def flush(self, timeout: float | None) -> None:
        """Wait until everything sent so far is confirmed.

        Raises:
            PublishError: some failed, or (spool) are still spooled after ``timeout``.
        """
        if self.spool is not None:
            self.spool.flush(timeout)
        self.publisher.flush(timeout)

    def close(self, timeout: float | None, *, delete_queue: str) -> None:
        """Stop the spool (what is unconfirmed stays on disk), then close the publisher.

        Raises:
            PublishError: (no spool) some tasks were not confirmed; everything is closed anyway.
        """
        try:
            if self.spool is not None:
                self.spool.close(self.publisher.settings.confirm_timeout_s if timeout is None else timeout)
        finally:
            self.publisher.close(timeout, delete_queue=delete_queue)
