"""Clockwork's own queues and streams: members, revocations, task states, dependents, chords, leaders.

Import these from ``broker_svc.topology``, which re-exports them: this module needs the specs
defined there, and ``broker_svc.topology`` imports it once they are.
"""

from __future__ import annotations

from typing import Any, Final

from broker_svc.topology import (
    DEFAULT_NAMESPACE,
    MEMBERS_ROUTING_KEY,
    ExchangeSpec,
    QueueSpec,
    event_exchange,
)

__all__ = [
    "EXPIRED_QUEUE",
    "beat_journal_stream",
    "beat_router_exchange",
    "beat_snapshot_queue",
    "beat_term_exchange",
    "chord_join_queue",
    "dedup_gate_queue",
    "dependents_queue",
    "leader_queue",
    "members_stream",
    "revocation_log",
    "task_states_stream",
]


# Every Clockwork stream is bounded by age and size, and dropped a segment at a time.
def _stream_arguments(*, max_age_s: int, segment_bytes: int, max_bytes: int) -> dict[str, Any]:
    return {
        "x-queue-type": "stream",
        "x-max-age": f"{max_age_s}s",
        "x-stream-max-segment-size-bytes": segment_bytes,
        "x-max-length-bytes": max_bytes,
    }


# A quorum queue one consumer at a time takes from (the joiners', the dependents', the leaders').
_SINGLE_ACTIVE_QUORUM: Final = {"x-queue-type": "quorum", "x-single-active-consumer": True}


# -- Clockwork's own durable streams (RabbitMQ streams; see docs/design.md, "Control plane") ------


def members_stream(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """A stream holding the last minute of worker events, bound to ``celeryev`` by ``worker.#``.

    A control client that has just started reads it from a minute ago to learn which workers are
    alive, so it can stop waiting once they have all answered. Small segments, because a stream
    drops old data a whole segment at a time.
    """
    return QueueSpec(
        name=f"clockwork.members.{namespace}",
        durable=True,
        arguments=_stream_arguments(max_age_s=60, segment_bytes=1_000_000, max_bytes=20_000_000),
        exchange=event_exchange(),
        routing_key=MEMBERS_ROUTING_KEY,
    )


def revocation_log(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """The durable log of revokes: every worker reads it from the start, so a revoke issued while
    no worker was running still holds. Entries live as long as a revoked id does (10,800 s).
    """
    return QueueSpec(
        name=f"clockwork.revoked.{namespace}",
        durable=True,
        arguments=_stream_arguments(max_age_s=10800, segment_bytes=4_000_000, max_bytes=200_000_000),
    )


def task_states_stream(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """The stream of task states (QUEUED from clients, the rest from workers; ``wire/task_state.py``).

    Bounded like a result: records live a day (Celery's ``result_expires``) and the stream holds at
    most 256 MB (about a million records), dropped a segment at a time, so a reader that starts from
    the beginning reads at most that much. A task older than both is UNKNOWN again.
    """
    return QueueSpec(
        name=f"clockwork.states.{namespace}",
        durable=True,
        arguments=_stream_arguments(max_age_s=86400, segment_bytes=8_000_000, max_bytes=256_000_000),
    )


def dependents_queue(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """Where tasks sent with ``depends_on`` wait until their dependencies finish.

    As the chord join queue: a quorum queue (waiting tasks survive the loss of a node) with a
    single active consumer, the one worker of the cluster that holds them unacked, follows the
    task-state stream, and releases each (publish and ack in one transaction) once its
    dependencies are done; if it dies, the broker hands them to the next worker.
    """
    return QueueSpec(
        name=f"clockwork.dependents.{namespace}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


def dedup_gate_queue(shard: int, namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """One shard of the keyed-deduplication gate (``broker_svc/wire/dedup.py``).

    A quorum queue with a single active consumer: one worker of the cluster keeps each shard's
    keys, holding head markers and waiting tasks unacked; if it dies the broker hands them to
    the next worker, which replays them (docs/architecture.md, "Deduplication under faults").
    """
    return QueueSpec(
        name=f"clockwork.dedup.{namespace}.{shard}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


def chord_join_queue(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """Where finished chord header tasks leave their parts for the joiner.

    A quorum queue, so the parts of a chord in progress survive the loss of a node, with a single
    active consumer: one worker of the cluster joins at a time, holding the parts of each chord
    unacked until it sends the body; if it dies they go to the next worker, which joins again.
    """
    return QueueSpec(
        name=f"clockwork.chords.{namespace}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


# Where RabbitMQ dead-letters tasks that expire in their queue (a Celery client sets the AMQP
# ``expiration`` of a task with ``expires``), given the operator's policy on the task queues:
#   rabbitmqctl set_policy clockwork-expired '^celery$' \
#     '{"dead-letter-exchange":"","dead-letter-routing-key":"clockwork.expired"}' --apply-to queues
# Every worker consumes it and answers each such task REVOKED "expired" (docs/guide.md, "Expiry").
EXPIRED_QUEUE: Final = "clockwork.expired"


def leader_queue(name: str) -> QueueSpec:
    """The election queue of the leader role ``name`` (``broker_svc/leader/``).

    A quorum queue, so the term's token survives the loss of a node, with a single active consumer:
    every candidate consumes it, the broker delivers only to the one active consumer, and moves
    activeness (with the unacked token) to the next candidate when that consumer's channel closes.
    Declared alike by every candidate (a different argument is a 406).
    """
    return QueueSpec(
        name=f"clockwork.leader.{name}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


def beat_journal_stream(name: str) -> QueueSpec:
    """The journal of the scheduler ``name`` (``broker_svc/beat/``): what it fired, what finished,
    and the schedule changes made at runtime.

    Each fire reaches its task queue and this stream in one publish (the stream is the message's
    ``BCC``), and fired tasks answer to it (their ``reply_to``), so a new leader reads here what
    the last one did. Records live a week, at most 256 MB; the leader saves its state every minute
    (``beat_snapshot_queue``), so only the records after the latest snapshot are ever read back.
    """
    return QueueSpec(
        name=f"clockwork.beat.{name}.journal",
        durable=True,
        arguments=_stream_arguments(max_age_s=604800, segment_bytes=8_000_000, max_bytes=256_000_000),
    )


def beat_snapshot_queue(name: str) -> QueueSpec:
    """The scheduler ``name``'s latest state and the journal offset it covers: one message.

    A quorum queue (it survives the loss of a node) holding at most one message: a new snapshot
    pushes the old one out (``drop-head``). Readers peek at it (get, then requeue).
    """
    return QueueSpec(
        name=f"clockwork.beat.{name}.snapshot",
        durable=True,
        arguments={"x-queue-type": "quorum", "x-max-length": 1, "x-overflow": "drop-head"},
    )


def beat_router_exchange(name: str) -> ExchangeSpec:
    """Where the scheduler ``name``'s fires are routed: each task queue is bound here by its
    name (and a named exchange by its routing key), the journal by its own name (the ``BCC``)."""
    return ExchangeSpec(name=f"clockwork.beat.{name}.router", type="direct", durable=True)


def beat_term_exchange(name: str, epoch: int) -> ExchangeSpec:
    """The one exchange the leader of term ``epoch`` fires through (bound to the router).

    The broker's fence: the next leader deletes it before reading the journal, so a publish from
    a leader that lost its term (frozen between its lease check and its publish) is refused (404)
    instead of firing a time the next leader fires too.
    """
    return ExchangeSpec(name=f"clockwork.beat.{name}.term.{epoch}", type="fanout", durable=True)
