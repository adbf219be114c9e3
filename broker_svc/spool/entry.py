"""One task in the spool, and its conversions to and from a spooled record."""

from __future__ import annotations

from broker_svc.connection.pending import PendingPublish
from broker_svc.settings import Settings
from broker_svc.spool.record import QueueKind, SpooledMessage
from broker_svc.topology import LEGACY_NAMESPACE, QueueSpec, dedup_gate_queue, task_queue
from broker_svc.wire.records.dedup import GATE_SHARDS

__all__ = ["Entry", "spooled_of", "template_of"]


def _gate_shard(queue: str, namespace: str) -> QueueSpec | None:
    # The gate shard a client sends tasks with dedup keys to, by name: declared as such on replay.
    shards = (dedup_gate_queue(shard, namespace) for shard in range(GATE_SHARDS))
    return next((spec for spec in shards if spec.name == queue), None)


class Entry:
    """A spooled task: its number, when it was spooled, and what publishes it.

    Attributes:
        seq: its number in the spool (order of acceptance).
        at: when it was spooled (epoch seconds).
        data: its record while it waits to be written; None once written (or read from disk).
        template: what each publish of it copies (the caller's handle, or a record read back).
        handle: the caller's handle, settled once the task is confirmed or fails for good; None
            for a task a crashed predecessor spooled, or one whose caller dropped its result.
        written: its record is in a segment file.
        settled: confirmed by the broker, or failed for good; it need not be written then.
        resend: an earlier publish may have been enqueued, so the next one is marked resent.
        retry_at: when a failed publish may go again (monotonic).
    """

    __slots__ = ("at", "data", "handle", "resend", "retry_at", "seq", "settled", "template", "written")

    def __init__(
        self,
        seq: int,
        at: float,
        template: PendingPublish,
        *,
        data: bytes | None = None,
        handle: PendingPublish | None = None,
        written: bool = False,
        resend: bool = False,
    ) -> None:
        self.seq = seq
        self.at = at
        self.data = data
        self.template = template
        self.handle = handle
        self.written = written
        self.settled = False
        self.resend = resend
        self.retry_at = 0.0


def spooled_of(pending: PendingPublish) -> SpooledMessage:
    """What the record of a prepared publish holds."""
    spec = pending.queue_declared
    queue_type: QueueKind | None = None
    if spec is not None:
        queue_type = "quorum" if spec.arguments.get("x-queue-type") == "quorum" else "classic"
    return SpooledMessage(
        exchange=pending.exchange,
        queue=pending.queue,
        queue_type=queue_type,
        eta_s=pending.eta_s,
        mandatory=pending.mandatory,
        message=pending.message,
    )


def template_of(spooled: SpooledMessage, *, settings: Settings | None = None) -> PendingPublish:
    """A publish of a record read back, declaring its queue as the first publish would have.

    The record keeps the queue's type; whether it is ordered or a priority queue comes from the
    replaying producer's ``settings`` (declared otherwise, an existing queue refuses it: 406).
    """
    kind = spooled.queue_type
    declare: tuple[QueueSpec, ...] = ()
    gate = _gate_shard(spooled.queue, settings.namespace if settings is not None else LEGACY_NAMESPACE)
    if gate is not None and kind is not None:
        declare = (gate,)  # a task with a dedup key: its gate shard (single active consumer)
    elif kind is not None:
        ordered = settings is not None and spooled.queue in settings.ordered_queues
        priority = settings.queue_max_priority if settings is not None else None
        declare = (task_queue(spooled.queue, queue_type=kind, single_active=ordered, max_priority=priority),)
    return PendingPublish(
        spooled.message,
        exchange=spooled.exchange,
        routing_key=spooled.queue,
        declare=declare,
        mandatory=spooled.mandatory,
        eta_s=spooled.eta_s,
    )
