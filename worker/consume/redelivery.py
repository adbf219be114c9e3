"""Redelivery bookkeeping: the tasks running here and done here, for a copy the broker sends back.

When a delivery's channel closes (consumer_timeout, a lost connection) the broker requeues it and
may hand it straight back to this worker while its first run is still going, or after that run
finished but its ack went out on the closed channel. ``Redeliveries`` remembers both — the runs in
progress by task id, and the recently finished ids with the channel their ack went out on — so the
consumer joins the running copy or acks the finished one instead of running the task twice. It is
separate from the consumer because it is one self-contained piece of state with its own rules
(which channel is gone, how many finished ids to keep), which the consumer only asks about.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aio_pika
import aio_pika.abc
import aiormq.abc
import structlog

from worker.pool.pool import JobOutcome

__all__ = ["Redeliveries", "Run", "channel_gone"]

log = structlog.get_logger(__name__)

# How many finished task ids to remember for redeliveries whose ack was lost (~100 bytes each).
_DONE_REMEMBERED = 10_000


@dataclass(slots=True)
class Run:
    """A task running in a child: its delivery, and its outcome for a redelivered copy to await."""

    message: aio_pika.abc.AbstractIncomingMessage
    outcome: asyncio.Future[JobOutcome]
    joined: bool = False

    def abandon(self, exc: BaseException) -> None:
        """The run ended without an outcome: pass its error to a joined copy, else cancel."""
        if self.joined and not isinstance(exc, asyncio.CancelledError):
            self.outcome.set_exception(exc)
        else:
            self.outcome.cancel()


class Redeliveries:
    """The tasks running here and those done here, by id, for redelivered copies of them."""

    def __init__(self) -> None:
        # Tasks running in children now, by id: a redelivered copy of one waits for it.
        self._runs: dict[str, Run] = {}
        # Tasks done here, oldest first → the channel their ack went out on (None: it could not).
        self._done: dict[str, aiormq.abc.AbstractChannel | None] = {}

    def orphaned_run(self, task_id: str) -> Run | None:
        """The run of ``task_id`` here whose own delivery's channel has closed, if any."""
        run = self._runs.get(task_id)
        if run is not None and channel_gone(run.message):
            return run
        return None

    def start(self, task_id: str, message: aio_pika.abc.AbstractIncomingMessage) -> Run:
        """Record that ``task_id`` starts running here from ``message``."""
        run = Run(message, asyncio.get_running_loop().create_future())
        self._runs[task_id] = run
        return run

    def end(self, task_id: str, run: Run) -> None:
        """Forget ``run`` (not a later run of the same id)."""
        if self._runs.get(task_id) is run:
            del self._runs[task_id]

    async def join(self, run: Run) -> JobOutcome | None:
        """Wait for ``run`` on behalf of its redelivered copy; its outcome, or None if it was cut short."""
        run.joined = True
        log.info("task_redelivery_joined_run")
        try:
            return await asyncio.shield(run.outcome)
        except asyncio.CancelledError:
            if not run.outcome.cancelled():
                raise  # this handler itself was cancelled
            return None  # cut short (shutdown): the caller hands this copy back unstarted

    def remember_done(self, task_id: str, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """Note that ``task_id`` finished here and was acked on ``message``'s channel."""
        # Everything a run leads to (result, retry, dead letter) has gone out by now; only the ack
        # may be lost, with its channel. The broker then redelivers the task.
        try:
            self._done[task_id] = message.channel
        except aio_pika.exceptions.ChannelInvalidStateError:
            self._done[task_id] = None
        if len(self._done) > _DONE_REMEMBERED:
            del self._done[next(iter(self._done))]

    def done_but_unacked(self, task_id: str) -> bool:
        """Whether a redelivery of ``task_id`` is of a task done here whose ack was lost."""
        # A redelivery of a task done here on a channel that has closed since: the broker never
        # got that ack (an acked message is not redelivered), so ack this copy, do not run it again.
        if task_id not in self._done:
            return False
        channel = self._done[task_id]
        if channel is not None and not channel.is_closed:
            return False  # acked on a live channel: a second message with the same id, run it
        del self._done[task_id]
        return True


def channel_gone(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """Whether the channel ``message`` came on is closed (its delivery tag means nothing now)."""
    # A delivery belongs to the channel it came on; once that is closed its tag means nothing.
    try:
        return message.channel.is_closed
    except aio_pika.exceptions.ChannelInvalidStateError:
        return True
