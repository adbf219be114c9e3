"""The task queues the worker's children consume: declared here, each as its clients declare it.

The worker's main process consumes no task queue: each pool child consumes for itself
(``worker/child``). The main process declares the queues (a 406 here stops the worker before any
child consumes a queue declared otherwise) and keeps the list the children are told; the control
commands change it (``add_consumer``, ``cancel_consumer``) and ``active_queues`` shows it.
"""

from __future__ import annotations

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings
from broker_svc.topology import QueueSpec, dead_letter_queue
from control.aio.declare import declare_queue

__all__ = ["TaskQueues", "declare_mismatch"]

log = structlog.get_logger(__name__)


class TaskQueues:
    """The task queues the children consume: the ones a user asked for, and Clockwork's own.

    Args:
        channel: a channel of the main process to declare them on.
        settings: the client settings (each queue is declared with its configured type).
    """

    def __init__(self, channel: aio_pika.abc.AbstractChannel, *, settings: Settings) -> None:
        self._channel = channel
        self._settings = settings
        self._listed: list[str] = []  # the queues a user asked for (active_queues), in order
        self._own: list[str] = []  # Clockwork's own (clockwork.expired): consumed, never listed

    async def declare(self, queue: str, *, listed: bool = True) -> None:
        """Declare ``queue`` and its dead-letter queue (as Celery does) for the children to consume.

        ``listed=False``: one of Clockwork's own queues (``clockwork.expired``), consumed as a task
        queue but left out of ``active_queues``, which shows the queues a user asked for.

        Raises:
            ConfigurationError: the queue exists with other arguments than the worker declares.
        """
        await declare_queue(self._channel, dead_letter_queue(queue))
        spec = self._settings.task_queue(queue)
        try:
            await declare_queue(self._channel, spec)
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            # Never consume it as declared before: an ordered queue that is not would run its
            # tasks on every worker at once.
            raise ConfigurationError(declare_mismatch(queue, spec, str(exc))) from None
        kept = self._listed if listed else self._own
        if queue not in kept:
            kept.append(queue)

    def remove(self, queue: str) -> bool:
        """The children stop consuming ``queue`` (``cancel_consumer``); whether they consumed it."""
        if queue not in self._listed:
            return False
        self._listed.remove(queue)
        return True

    def listed(self) -> list[str]:
        """The task queues consumed now that a user asked for (``active_queues``)."""
        return list(self._listed)

    def consumed(self) -> list[str]:
        """Every queue the children consume now: the listed ones, then Clockwork's own."""
        return [*self._listed, *self._own]


def declare_mismatch(queue: str, spec: QueueSpec, error: str) -> str:
    """What to say when the broker refused ``spec`` because ``queue`` exists with other arguments."""
    wanted = spec.arguments or "none"
    return (
        f"task queue {queue!r} exists with other arguments than this worker declares ({wanted}); "
        f"the broker said: {error}. An ordered queue (--ordered-queues, task_ordered_queues) or a "
        "quorum queue must be declared so by every client and worker from its creation: delete "
        f"the queue (rabbitmqctl delete_queue {queue}) once drained, or make the settings agree"
    )
