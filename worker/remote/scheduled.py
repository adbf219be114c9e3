"""``inspect scheduled``: the ETA tasks this worker parked in the delay queues, read back from the stream.

A task not yet due waits in one of its queue's delay queues, not in a worker (docs/design.md,
ETA), so nothing in a worker's memory lists it. Each park is a record on the app's scheduled
stream (``worker/rules/parked.py``, written by the parking child before its ack). Every worker
follows the stream from its start and keeps each task's latest record: it lists the tasks whose
latest park was its own and whose ETA has not passed. A task parked again by another worker
moves to that worker's list; one that came due leaves every list. Read from the start, the list
is the same after a restart of the worker (under the same node name).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.errors import MessageError
from broker_svc.topology import scheduled_stream
from worker.rules.parked import Parked

__all__ = ["ScheduledLog"]

log = structlog.get_logger(__name__)

_PREFETCH: Final = 1000
# A subscription that fails (a stream declared by several workers at once, a refused permission)
# is tried again after these pauses, then every last one.
_RETRY_PAUSES_S: Final = (0.25, 0.5, 1.0, 2.0, 5.0, 30.0)


class ScheduledLog:
    """Each parked task's latest record, from the app's scheduled stream.

    Args:
        hostname: this node: the records it lists are its own.
        namespace: the app namespace, which names the stream.
    """

    def __init__(self, *, hostname: str, namespace: str) -> None:
        self._hostname = hostname
        self._spec = scheduled_stream(namespace)
        self._latest: dict[str, Parked] = {}
        self.records_read = 0

    def listed(self, *, now: float | None = None) -> list[dict[str, Any]]:
        """Celery's ``scheduled`` reply: this worker's parked tasks not yet due, soonest first."""
        moment = time.time() if now is None else now
        for task_id in [tid for tid, parked in self._latest.items() if parked.eta <= moment]:
            del self._latest[task_id]  # came due: back in its task queue, or run
        mine = sorted((p for p in self._latest.values() if p.hostname == self._hostname), key=lambda p: p.eta)
        return [parked.reply() for parked in mine]

    def find(self, task_id: str, *, now: float | None = None) -> dict[str, Any] | None:
        """The TASK_INFO of ``task_id`` if this worker lists it as scheduled (``query_task``)."""
        parked = self._latest.get(task_id)
        moment = time.time() if now is None else now
        if parked is None or parked.hostname != self._hostname or parked.eta <= moment:
            return None
        return parked.info

    async def follow(self, channel: Callable[[], Awaitable[aio_pika.abc.AbstractChannel]]) -> None:
        """Subscribe from the stream's start, again after each failure; until cancelled."""
        attempt = 0
        while True:
            try:
                opened = await channel()
                try:
                    await opened.set_qos(prefetch_count=_PREFETCH)
                    spec = self._spec
                    queue = await opened.declare_queue(
                        spec.name, durable=spec.durable, arguments=spec.arguments
                    )
                    self._latest.clear()  # read again from the start
                    await queue.consume(self._on_record, arguments={"x-stream-offset": "first"})
                    attempt = 0
                    underlay = await opened.get_underlay_channel()
                    with contextlib.suppress(Exception):  # however it ends: subscribe again
                        await underlay.closing  # until the channel (or its connection) ends
                finally:
                    if not opened.is_closed:
                        with contextlib.suppress(
                            aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError
                        ):
                            await opened.close()
            except asyncio.CancelledError:
                raise
            except (aio_pika.exceptions.AMQPError, ConnectionError, RuntimeError) as exc:
                pause_s = _RETRY_PAUSES_S[min(attempt, len(_RETRY_PAUSES_S) - 1)]
                attempt += 1
                log.warning(
                    "scheduled_log_retrying", queue=self._spec.name, error=str(exc), retry_in_s=pause_s
                )
                await asyncio.sleep(pause_s)

    async def _on_record(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            parked = Parked.decode(message.body)
        except MessageError as exc:
            log.warning("scheduled_record_refused", error=str(exc), size=len(message.body))
        else:
            self.records_read += 1
            if parked.eta > time.time():
                self._latest[parked.task_id] = parked
            else:
                self._latest.pop(parked.task_id, None)
        with contextlib.suppress(aio_pika.exceptions.AMQPError):
            await message.ack()  # a stream hands out more records only as earlier ones are acked
