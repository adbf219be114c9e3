"""The client's park records: an ETA task it sends straight to a delay queue, noted for ``inspect scheduled``.

A worker that parks a task records the park on the app's scheduled stream; our client parks ETA
tasks itself (``PendingPublish.route``), so it writes the record, with no worker's name, and one
live worker that consumes the task's queue lists it (``worker/remote/scheduled.py``) until a
worker parks it again (each round trip) or it comes due.

A record is a side matter, never a reason to lose or hold up its task: it is published after its
task, through the default exchange with no declaration (a producer needs no configure permission
on the stream, and a refused declaration would close the channel its tasks share), not
mandatory (before any worker of the app started there is no stream, and no one to list it), and
nobody waits on its confirm (``best_effort``): a record that fails is logged, and its task is
listed once a worker parks it again.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog

from broker_svc.connection.pending import PendingPublish
from broker_svc.topology import DEFAULT_EXCHANGE, DELAY_HOLD_WINDOW_S, scheduled_stream
from broker_svc.wire.records.parked import CONTENT_TYPE, parked_record
from broker_svc.wire.task.task_message import TaskMessage, WireMessage

__all__ = ["park_records"]

log = structlog.get_logger(__name__)


def park_records(
    sent: Sequence[tuple[PendingPublish, TaskMessage]], *, namespace: str, now: float
) -> list[PendingPublish]:
    """The park records of the tasks in ``sent`` that go to a delay queue, to publish after them.

    Args:
        sent: each prepared task and its message.
        namespace: the app namespace, which names the scheduled stream.
        now: the wall clock (epoch seconds): tasks due within the hold window are not parked.
    """
    records: list[PendingPublish] = []
    stream = None
    for pending, message in sent:
        # Only a task sent to its queue on the default exchange has ``eta_s`` (prepare_publish):
        # one sent to a named exchange or a dedup gate is parked, and recorded, by a worker.
        if pending.eta_s is None or pending.eta_s - now <= DELAY_HOLD_WINDOW_S:
            continue
        if stream is None:
            stream = scheduled_stream(namespace)
        delivery_info = {
            "exchange": "",
            "routing_key": pending.queue,
            "priority": message.priority,
            "redelivered": False,
        }
        body = parked_record(message, hostname=None, delivery_info=delivery_info, queue=pending.queue)
        record = PendingPublish(
            WireMessage(body=body, content_type=CONTENT_TYPE, content_encoding="utf-8", headers={}),
            exchange=DEFAULT_EXCHANGE,
            routing_key=stream.name,
            mandatory=False,
            best_effort=True,
        )
        record.on_settle = _settled
        records.append(record)
    return records


def _settled(record: PendingPublish) -> None:
    # On the I/O thread (or the asyncio client's loop): say why, and carry on.
    if record.error is not None:
        log.warning("park_record_failed", queue=record.routing_key, error=str(record.error))
