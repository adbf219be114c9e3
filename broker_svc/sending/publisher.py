"""The publisher: encodes tasks, hands them to the connection, and keeps account of confirms."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from types import TracebackType

from broker_svc.clock import LamportClock
from broker_svc.connection.channel import Consumer
from broker_svc.connection.io_thread import BrokerConnection
from broker_svc.connection.pending import PendingPublish, prepare_publish
from broker_svc.errors import BrokerSvcError, PublishError
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec, QueueType
from broker_svc.wire.task.task_message import TaskMessage

__all__ = ["Publisher"]


class Publisher:
    """Publishes task messages with pipelined publisher confirms.

    ``send`` returns once the message is handed to the connection (``confirm="pipelined"``) or
    once the broker confirmed it (``confirm="each"``). ``flush`` waits for every confirm and reports
    what failed. Thread-safe; use it as a context manager or call ``close``.

    Args:
        settings: connection and publishing settings.
        clock: the process's Lamport clock, forwarded for every message.
        name: connection name shown by the broker.
        consumers: queues the same connection consumes (a client's result queue).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        clock: LamportClock,
        name: str = "clockwork-publisher",
        consumers: Sequence[tuple[QueueSpec, Consumer]] = (),
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._connection = BrokerConnection(settings, name=name, consumers=consumers)
        self._lock = threading.Lock()
        self._inflight: deque[PendingPublish] = deque()
        self._failed: list[PendingPublish] = []

    @property
    def settings(self) -> Settings:
        """The settings it was made with."""
        return self._settings

    @property
    def connection(self) -> BrokerConnection:
        """The underlying connection (for result queues and control calls on it)."""
        return self._connection

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def prepare(
        self,
        message: TaskMessage,
        *,
        queue: str,
        queue_type: QueueType = "classic",
        serializer: str | None = None,
        exchange: str | None = None,
    ) -> PendingPublish:
        """Stamp the clock, encode and size-check a task; nothing is sent yet.

        A task whose ETA is more than ``DELAY_HOLD_WINDOW_S`` away when it is sent goes to one of
        ``queue``'s delay queues instead, which hands it back to ``queue`` no later than its ETA
        (docs/design.md, "ETA and countdown"). The message itself is the same either way.

        Raises:
            MessageTooLarge: the body is over ``max_body_bytes`` (checked before publishing).
            TypeError: an argument cannot be encoded.

        ``exchange``: publish there, with ``queue`` as the routing key, instead of to the queue.
        """
        return prepare_publish(
            message, settings=self._settings, clock=self._clock, queue=queue, queue_type=queue_type,
            serializer=serializer, exchange=exchange,
        )  # fmt: skip

    def submit(self, items: Sequence[PendingPublish], *, wait: bool | None = None) -> None:
        """Hand prepared messages to the connection; in ``each`` mode wait for their confirms.

        ``wait``: wait for their confirms (one wait for all of them) whatever the mode. A side
        record among them (``best_effort``) is sent in its place but never waited on or reported.

        Raises:
            PublishError: (``each`` mode or ``wait``) a message was not confirmed.
            BrokerUnavailable: the publisher is closed or the broker unreachable.
        """
        each = self._settings.confirm == "each" if wait is None else wait
        # Side records (``best_effort``) go out with the tasks, but nobody waits on them.
        tasks = [p for p in items if not p.best_effort]
        with self._lock:
            self._prune()
            if not each:
                self._inflight.extend(tasks)
        self._connection.publish_many(items)
        if each:
            # Failures raise here, once; only what is still unsettled is left for ``flush``.
            deadline = time.monotonic() + self._settings.confirm_timeout_s + self._settings.reconnect_window_s
            for pending in tasks:
                pending.wait(max(0.0, deadline - time.monotonic()))
            unsettled = [p for p in tasks if not p.done]
            if unsettled:
                with self._lock:
                    self._inflight.extend(unsettled)
                raise PublishError(f"no confirm within {self._settings.confirm_timeout_s} s")
            error = next((p.error for p in tasks if p.error is not None), None)
            if error is not None:
                raise error

    def send(self, message: TaskMessage, *, queue: str, queue_type: QueueType = "classic") -> PendingPublish:
        """Prepare and submit one task.

        Raises:
            MessageTooLarge: the body is over the limit (nothing was sent).
            PublishError: (``each`` mode) the broker did not confirm it.
        """
        pending = self.prepare(message, queue=queue, queue_type=queue_type)
        self.submit((pending,))
        return pending

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message handed over so far is confirmed.

        Raises:
            PublishError: some messages failed or stayed unconfirmed; the error says how many and why.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            waiting = list(self._inflight)
            self._inflight.clear()
            failed, self._failed = self._failed, []
        unconfirmed = 0
        for pending in waiting:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not pending.wait(remaining):
                unconfirmed += 1
                with self._lock:
                    self._inflight.append(pending)
            elif pending.error is not None:
                failed.append(pending)
        if failed or unconfirmed:
            first: BrokerSvcError | None = failed[0].error if failed else None
            why = self._connection.unavailable() if unconfirmed else None
            error = PublishError(
                f"{len(failed)} message(s) failed and {unconfirmed} unconfirmed"
                + (f"; first error: {first}" if first else f" after {timeout} s")
                + (f": {why}" if why else "")
            )
            raise error from first

    def close(self, timeout: float | None = None, *, delete_queue: str | None = None) -> None:
        """Flush, delete ``delete_queue`` (a client's result queue) if given, then close the connection.

        Raises:
            PublishError: what ``flush`` raises; the queue is deleted and the connection closed all
                the same.
        """
        timeout = self._settings.confirm_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            self.flush(timeout)
        finally:
            # What is left of ``timeout`` bounds the rest: a broker that is down never answers.
            if delete_queue is not None and self._connection.can_publish:
                try:
                    self._connection.delete_queue(delete_queue, timeout=min(2.0, _left(deadline)))
                except BrokerSvcError:
                    pass  # its x-expires removes it later
            self._connection.close(timeout=_left(deadline))

    def _prune(self) -> None:
        # Drop settled messages from the front so a long-running producer keeps a bounded list.
        inflight = self._inflight
        while inflight and inflight[0].done:
            pending = inflight.popleft()
            if pending.error is not None:
                self._failed.append(pending)


def _left(deadline: float) -> float:
    # What is left until ``deadline``, never negative.
    return max(0.0, deadline - time.monotonic())
