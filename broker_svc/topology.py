"""Every exchange and queue name and every declare argument, in one place.

Task queues and exchanges are declared exactly as Celery declares them (a difference is a 406 from
RabbitMQ on the other side's redeclare), so Celery clients and workers can share them with us.
"""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypedDict

__all__ = [
    "DEAD_LETTER_AT_HEADER",
    "DEAD_LETTER_ERROR_HEADER",
    "DEAD_LETTER_QUEUE_HEADER",
    "DEAD_LETTER_REASON_HEADER",
    "DEAD_LETTER_REQUEUED_HEADER",
    "DEFAULT_EXCHANGE",
    "DELAY_HOLD_WINDOW_S",
    "MAX_DELAY_BUCKET_MS",
    "MIN_DELAY_BUCKET_MS",
    "ExchangeOptions",
    "ExchangeSpec",
    "QueueOptions",
    "QueueSpec",
    "QueueType",
    "SINGLE_ACTIVE_ARGUMENT",
    "MAX_PRIORITY_ARGUMENT",
    "EVENT_EXCHANGE",
    "MEMBERS_ROUTING_KEY",
    "beat_journal_stream",
    "beat_router_exchange",
    "beat_snapshot_queue",
    "beat_term_exchange",
    "chord_join_queue",
    "control_reply_queue",
    "dead_letter_lock_queue",
    "dead_letter_queue",
    "delay_bucket_ms",
    "delay_queue",
    "dedup_gate_queue",
    "dependents_queue",
    "event_exchange",
    "event_queue",
    "expired_queue",
    "LEGACY_NAMESPACE",
    "app_namespace",
    "scoped_name",
    "leader_queue",
    "members_stream",
    "new_reply_queue_name",
    "node_queue",
    "ordered_queue",
    "pidbox_exchange",
    "reply_exchange",
    "result_queue",
    "revocation_log",
    "scheduled_stream",
    "settled_chords_stream",
    "task_exchange",
    "task_queue",
    "task_states_stream",
]

# Tasks and results are published to the default exchange with the queue's name as routing key,
# as Celery does for direct queues (WIRE.md §3.4).
DEFAULT_EXCHANGE: Final = ""

DEAD_LETTER_REASON_HEADER: Final = "x-clockwork-reason"
DEAD_LETTER_ERROR_HEADER: Final = "x-clockwork-error"
DEAD_LETTER_QUEUE_HEADER: Final = "x-clockwork-queue"
DEAD_LETTER_AT_HEADER: Final = "x-clockwork-dead-at"  # ISO-8601, UTC, when the worker dead-lettered it
# Set by ``ctl dead requeue`` on the task it publishes again: a map of the requeue (count, time, by
# whom, from which dead queue, the earlier reason and the dead letter's key); docs/guide.md,
# "Handling dead letters".
DEAD_LETTER_REQUEUED_HEADER: Final = "x-clockwork-requeued"

# The queue argument of an ordered task queue: the broker delivers to one consumer at a time and
# moves that role to the next consumer (in the order they subscribed) when its channel closes.
SINGLE_ACTIVE_ARGUMENT: Final = "x-single-active-consumer"
# The queue argument of a priority queue: messages of a higher ``priority`` (up to it) go first.
MAX_PRIORITY_ARGUMENT: Final = "x-max-priority"

QueueType = Literal["classic", "quorum"]

# Delay queues hold ETA tasks for a power of two of milliseconds, from 128 ms to about 24.9 days
# (a task due later goes round the longest again). Tasks due within the hold window (by default
# the shortest bucket) wait in the worker's memory. See docs/design.md, "ETA and countdown".
MIN_DELAY_BUCKET_MS: Final = 2**7
MAX_DELAY_BUCKET_MS: Final = 2**31
DELAY_HOLD_WINDOW_S: Final = MIN_DELAY_BUCKET_MS / 1000


# Every declarer (the I/O thread's pika callback chain, the control client's blocking pika, aio-pika
# in a worker) reads a spec through ``declare_options()``: a flag or argument that differs from an
# earlier declaration of the same queue or exchange is a 406 PRECONDITION_FAILED from RabbitMQ.


class ExchangeOptions(TypedDict):
    """exchange.declare's flags, under the keyword names pika and aio-pika both take."""

    durable: bool
    auto_delete: bool


class QueueOptions(TypedDict):
    """queue.declare's flags and arguments, under the keyword names pika and aio-pika both take."""

    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict[str, Any] | None  # None, not {}: what every declarer sent before this existed


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    """How to declare an exchange."""

    name: str
    type: Literal["direct", "fanout", "topic", "headers"]
    durable: bool
    auto_delete: bool = False

    def declare_options(self) -> ExchangeOptions:
        """exchange.declare's flags (the name and type go apart: pika's keyword is ``exchange_type``)."""
        return {"durable": self.durable, "auto_delete": self.auto_delete}


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """How to declare a queue, and what to bind it to."""

    name: str
    durable: bool
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = field(default_factory=dict)
    exchange: ExchangeSpec | None = None
    routing_key: str = ""

    def declare_options(self) -> QueueOptions:
        """queue.declare's flags and arguments; the binding is ``exchange`` and ``routing_key``."""
        return {
            "durable": self.durable,
            "exclusive": self.exclusive,
            "auto_delete": self.auto_delete,
            "arguments": self.arguments or None,
        }

    @property
    def single_active(self) -> bool:
        """Whether the broker lets one consumer at a time take from it (an ordered queue)."""
        return self.arguments.get(SINGLE_ACTIVE_ARGUMENT) is True


@functools.lru_cache(maxsize=1024)
def task_exchange(queue: str) -> ExchangeSpec:
    """The direct exchange Celery pairs with a task queue (same name as the queue)."""
    return ExchangeSpec(name=queue, type="direct", durable=True)


@functools.lru_cache(maxsize=1024)  # built for every publish; specs are never mutated
def task_queue(
    queue: str,
    *,
    queue_type: QueueType = "classic",
    single_active: bool = False,
    max_priority: int | None = None,
) -> QueueSpec:
    """A task queue: durable, no arguments (as Celery), bound to its exchange by its own name.

    A quorum queue must be chosen on both sides (``Settings.quorum_queues``); Celery's
    ``task_default_queue_type`` / ``task_create_missing_queue_type`` must match. So must an
    ordered queue (``single_active``, ``Settings.ordered_queues``): Celery's side declares it with
    ``Queue(name, queue_arguments={"x-single-active-consumer": True})`` in ``task_queues``. And so
    must a priority queue (``max_priority``, ``Settings.queue_max_priority``; Celery's
    ``task_queue_max_priority``): classic queues only, RabbitMQ 3.10's quorum queues have none.
    """
    arguments: dict[str, Any] = {} if queue_type == "classic" else {"x-queue-type": "quorum"}
    if single_active:
        arguments[SINGLE_ACTIVE_ARGUMENT] = True
    if max_priority is not None and queue_type == "classic":
        arguments[MAX_PRIORITY_ARGUMENT] = max_priority
    return QueueSpec(
        name=queue,
        durable=True,
        arguments=arguments,
        exchange=task_exchange(queue),
        routing_key=queue,
    )


def ordered_queue(queue: str, *, queue_type: QueueType = "classic") -> QueueSpec:
    """An ordered task queue: one consumer of all workers takes its tasks, one at a time, in order.

    ``task_queue`` with ``x-single-active-consumer``; a worker consumes it with prefetch 1 and
    never cancels its consumer while it holds one of its deliveries (docs/guide.md, "Ordered queues").
    """
    return task_queue(queue, queue_type=queue_type, single_active=True)


def dead_letter_queue(queue: str) -> QueueSpec:
    """Where messages from ``queue`` that cannot or must not run are kept, with their reason.

    Dead letters are published to it explicitly (DESIGN §4), so task queues need no DLX argument
    and stay equal to Celery's declarations.
    """
    return QueueSpec(name=f"{queue}.dead", durable=True)


def dead_letter_lock_queue(queue: str) -> QueueSpec:
    """The lock of ``queue``'s dead-letter queue: whoever declares it (exclusive) reads and
    requeues ``<queue>.dead`` alone; the broker lets go of it when that connection closes or dies."""
    return QueueSpec(name=f"{queue}.dead.lock", durable=False, exclusive=True)


def new_reply_queue_name() -> str:
    """A fresh name for one client's result queue (used as the tasks' ``reply_to``)."""
    return f"clockwork.reply.{uuid.uuid4()}"


def result_queue(name: str, *, expires_s: int) -> QueueSpec:
    """A client's result queue.

    Durable and not exclusive, so results published while the client reconnects are kept (and
    RabbitMQ 4.3 refuses transient non-exclusive queues); ``x-expires`` removes it once its client
    has been gone for ``expires_s``.
    """
    return QueueSpec(name=name, durable=True, arguments={"x-expires": expires_s * 1000})


def delay_bucket_ms(remaining_s: float, *, hold_window_s: float) -> int | None:
    """Which delay queue a task due in ``remaining_s`` seconds waits in, by its TTL in ms.

    The largest power of two of milliseconds not above what is left (capped at
    ``MAX_DELAY_BUCKET_MS``), so a parked task never comes back after its ETA, and each round trip
    at least halves what is left: a task due in an hour goes round at most 15 times.

    Args:
        remaining_s: seconds until the task is due.
        hold_window_s: tasks due within this many seconds are not parked.

    Returns:
        The bucket in milliseconds, or None when the task is due within the hold window or sooner
        than the shortest bucket.

    Raises:
        ValueError: ``hold_window_s`` is negative.
    """
    if hold_window_s < 0:
        raise ValueError(f"hold_window_s must not be negative, got {hold_window_s}")
    remaining_ms = remaining_s * 1000
    if not (remaining_s > hold_window_s and remaining_ms >= MIN_DELAY_BUCKET_MS):  # NaN is neither
        return None
    if remaining_ms >= MAX_DELAY_BUCKET_MS:
        return MAX_DELAY_BUCKET_MS
    return 1 << (int(remaining_ms).bit_length() - 1)


@functools.lru_cache(maxsize=1024)  # built for every parked publish; specs are never mutated
def delay_queue(queue: str, bucket_ms: int) -> QueueSpec:
    """The queue where tasks for ``queue`` wait ``bucket_ms`` milliseconds before going back to it.

    Every message in it has the same TTL (the queue's), so its order is expiry order and nothing
    waits behind a message that expires later. An expired message is dead-lettered through the
    default exchange to ``queue``, which must exist by then: RabbitMQ drops a dead letter that
    routes nowhere. There is deliberately no ``x-expires``: publishing does not count as use, so
    a queue that only ever receives messages would be deleted with its messages in it.

    Raises:
        ValueError: ``bucket_ms`` is not a power of two between the shortest and longest bucket.
    """
    if not (MIN_DELAY_BUCKET_MS <= bucket_ms <= MAX_DELAY_BUCKET_MS and bucket_ms & (bucket_ms - 1) == 0):
        raise ValueError(
            f"bucket_ms must be a power of two in [{MIN_DELAY_BUCKET_MS}, {MAX_DELAY_BUCKET_MS}], "
            f"got {bucket_ms}"
        )
    return QueueSpec(
        name=f"{queue}.delay.{bucket_ms}ms",
        durable=True,
        arguments={
            "x-message-ttl": bucket_ms,
            "x-dead-letter-exchange": DEFAULT_EXCHANGE,
            "x-dead-letter-routing-key": queue,
        },
    )


# -- the mailbox (Celery's pidbox, WIRE.md §5) ---------------------------------------------------

DEFAULT_NAMESPACE: Final = "celery"


def pidbox_exchange(namespace: str = DEFAULT_NAMESPACE) -> ExchangeSpec:
    """The fanout exchange control requests are broadcast on (non-durable, as Celery's)."""
    return ExchangeSpec(name=f"{namespace}.pidbox", type="fanout", durable=False)


def reply_exchange(namespace: str = DEFAULT_NAMESPACE) -> ExchangeSpec:
    """The direct exchange control replies go to, routed by the caller's key."""
    return ExchangeSpec(name=f"reply.{namespace}.pidbox", type="direct", durable=False)


def node_queue(nodename: str, namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """A worker's own mailbox queue: exclusive, gone 10 s after its node, requests live 300 s."""
    return QueueSpec(
        name=f"{nodename}.{namespace}.pidbox",
        durable=False,
        exclusive=True,
        auto_delete=True,
        arguments={"x-expires": 10_000, "x-message-ttl": 300_000},
        exchange=pidbox_exchange(namespace),
        routing_key="",
    )


def control_reply_queue(namespace: str = DEFAULT_NAMESPACE) -> QueueSpec:
    """A control client's own reply queue ``<oid>.reply.<ns>.pidbox``, bound by its ``<oid>``."""
    oid = str(uuid.uuid4())
    return QueueSpec(
        name=f"{oid}.reply.{namespace}.pidbox",
        durable=False,
        exclusive=True,
        auto_delete=True,
        arguments={"x-expires": 10_000, "x-message-ttl": 300_000},
        exchange=reply_exchange(namespace),
        routing_key=oid,
    )


# -- events (Celery's celeryev, WIRE.md §7) -------------------------------------------------------

EVENT_EXCHANGE: Final = "celeryev"
# Worker events (online, heartbeat, offline) are routed ``worker.<what>``.
MEMBERS_ROUTING_KEY: Final = "worker.#"


def event_exchange() -> ExchangeSpec:
    """The topic exchange events are published on (durable, as Celery declares it)."""
    return ExchangeSpec(name=EVENT_EXCHANGE, type="topic", durable=True)


def event_queue(routing_key: str = "#") -> QueueSpec:
    """A live event receiver's queue: exclusive, events older than 5 s dropped (as Celery's)."""
    return QueueSpec(
        name=f"celeryev.{uuid.uuid4()}",
        durable=False,
        exclusive=True,
        auto_delete=True,
        arguments={"x-message-ttl": 5_000, "x-expires": 60_000},
        exchange=event_exchange(),
        routing_key=routing_key,
    )


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


# -- an app's namespace: the key of the state its clients and workers share ----------------------

# The namespace of an app that sets none: its names are those Clockwork used before namespaces.
LEGACY_NAMESPACE: Final = "celery"

_NAMESPACE_CHARS: Final = re.compile(r"[A-Za-z0-9_.:-]{1,100}")


def app_namespace(explicit: str | None) -> str:
    """The namespace keying an app's shared state (chords, dedup gates, dependents, task states,
    revokes, schedulers, leaders, expired tasks): the ``app_namespace`` setting, else ``celery``.

    Not the app's name by default: a client app of another name (a web app sending by task name)
    must reach the same gates, states and revokes as the workers; apps that share a vhost set one
    each, clients and workers alike (docs/guide.md, "Many apps on one broker").

    Raises:
        ValueError: a namespace that cannot be part of a queue name.
    """
    namespace = explicit or LEGACY_NAMESPACE
    if not _NAMESPACE_CHARS.fullmatch(namespace):
        raise ValueError(f"app_namespace {namespace!r} must be 1-100 of A-Z a-z 0-9 _ . : -")
    return namespace


def _scope(namespace: str) -> str:
    # Names that had no namespace before (leaders, schedulers, expired tasks) keep their form in
    # the legacy namespace, so an unnamed app's running cluster finds its state where it was.
    return "" if namespace == LEGACY_NAMESPACE else f".{namespace}"


def scoped_name(namespace: str, name: str) -> str:
    """``name`` (a scheduler's, say) within ``namespace``: ``<namespace>.<name>``, or ``name`` alone
    in the legacy namespace."""
    return f"{namespace}.{name}" if namespace != LEGACY_NAMESPACE else name


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


def revocation_log(namespace: str) -> QueueSpec:
    """The durable log of revokes: every worker reads it from the start, so a revoke issued while
    no worker was running still holds. Entries live as long as a revoked id does (10,800 s).
    """
    return QueueSpec(
        name=f"clockwork.revoked.{namespace}",
        durable=True,
        arguments=_stream_arguments(max_age_s=10800, segment_bytes=4_000_000, max_bytes=200_000_000),
    )


def task_states_stream(namespace: str) -> QueueSpec:
    """The stream of task states (QUEUED from clients, the rest from workers; ``wire/records/task_state.py``).

    Bounded like a result: records live a day (Celery's ``result_expires``) and the stream holds at
    most 256 MB (about a million records), dropped a segment at a time, so a reader that starts from
    the beginning reads at most that much. A task older than both is UNKNOWN again.
    """
    return QueueSpec(
        name=f"clockwork.states.{namespace}",
        durable=True,
        arguments=_stream_arguments(max_age_s=86400, segment_bytes=8_000_000, max_bytes=256_000_000),
    )


def dependents_queue(namespace: str) -> QueueSpec:
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


def scheduled_stream(namespace: str) -> QueueSpec:
    """The ETA tasks workers parked in the app's delay queues: one record per park (id, ETA, the
    request, the worker), so ``inspect scheduled`` lists them from any restart of that worker.

    A task parked again (each round trip takes a shorter delay queue) has a newer record; one whose
    ETA has passed is no longer listed. Records live as long as the longest delay queue holds a
    task, plus a day; at most 256 MB.
    """
    return QueueSpec(
        name=f"clockwork.scheduled.{namespace}",
        durable=True,
        arguments=_stream_arguments(
            max_age_s=MAX_DELAY_BUCKET_MS // 1000 + 86400, segment_bytes=4_000_000, max_bytes=256_000_000
        ),
    )


def dedup_gate_queue(shard: int, namespace: str) -> QueueSpec:
    """One shard of the keyed-deduplication gate (``broker_svc/wire/records/dedup.py``).

    A quorum queue with a single active consumer: one worker of the cluster keeps each shard's
    keys, holding head markers and waiting tasks unacked; if it dies the broker hands them to
    the next worker, which replays them (docs/architecture.md, "Deduplication under faults").
    """
    return QueueSpec(
        name=f"clockwork.dedup.{namespace}.{shard}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


@functools.lru_cache(maxsize=64)  # named for every chord part a child sends; specs are never mutated
def chord_join_queue(namespace: str) -> QueueSpec:
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


def settled_chords_stream(namespace: str) -> QueueSpec:
    """The record of the chords the joiners settled lately: one marker per chord.

    A joiner publishes a chord's marker in the transaction that sends its body and acks its parts,
    and reads the stream from its start when it becomes the active joiner, so a copy of a part that
    comes after its chord was settled (by any joiner) is acked, never held or joined again. Markers
    live a day, as a result does (Celery's ``result_expires``), and the stream holds at most 64 MB
    (about 290,000 markers, a day of 3 chords a second), dropped a segment at a time.
    """
    return QueueSpec(
        name=f"clockwork.chords.{namespace}.settled",
        durable=True,
        arguments=_stream_arguments(max_age_s=86400, segment_bytes=4_000_000, max_bytes=64_000_000),
    )


def expired_queue(namespace: str) -> str:
    """Where RabbitMQ dead-letters the app's tasks that expire in their queue (a Celery client sets
    the AMQP ``expiration`` of a task with ``expires``), given the operator's policy on its queues::

        rabbitmqctl set_policy clockwork-expired '^celery$' \\
          '{"dead-letter-exchange":"","dead-letter-routing-key":"clockwork.expired"}' --apply-to queues

    Every worker of the app consumes it and answers each such task REVOKED "expired"
    (docs/guide.md, "Expiry"). The namespace ``celery`` keeps the earlier name, ``clockwork.expired``.
    """
    return f"clockwork.expired{_scope(namespace)}"


def leader_queue(name: str, namespace: str) -> QueueSpec:
    """The election queue of the app's leader role ``name`` (``worker/leader/``).

    A quorum queue, so the term's token survives the loss of a node, with a single active consumer:
    every candidate consumes it, the broker delivers only to the one active consumer, and moves
    activeness (with the unacked token) to the next candidate when that consumer's channel closes.
    Declared alike by every candidate (a different argument is a 406).
    """
    return QueueSpec(
        name=f"clockwork.leader{_scope(namespace)}.{name}",
        durable=True,
        arguments=dict(_SINGLE_ACTIVE_QUORUM),
    )


def beat_journal_stream(name: str, namespace: str) -> QueueSpec:
    """The journal of the scheduler ``name`` (``worker/beat/``): what it fired, what finished,
    and the schedule changes made at runtime.

    Each fire reaches its task queue and this stream in one publish (the stream is the message's
    ``BCC``), and fired tasks answer to it (their ``reply_to``), so a new leader reads here what
    the last one did. Records live a week, at most 256 MB; the leader saves its state every minute
    (``beat_snapshot_queue``), so only the records after the latest snapshot are ever read back.
    """
    return QueueSpec(
        name=f"clockwork.beat.{scoped_name(namespace, name)}.journal",
        durable=True,
        arguments=_stream_arguments(max_age_s=604800, segment_bytes=8_000_000, max_bytes=256_000_000),
    )


def beat_snapshot_queue(name: str, namespace: str) -> QueueSpec:
    """The scheduler ``name``'s latest state and the journal offset it covers: one message.

    A quorum queue (it survives the loss of a node) holding at most one message: a new snapshot
    pushes the old one out (``drop-head``). Readers peek at it (get, then requeue).
    """
    return QueueSpec(
        name=f"clockwork.beat.{scoped_name(namespace, name)}.snapshot",
        durable=True,
        arguments={"x-queue-type": "quorum", "x-max-length": 1, "x-overflow": "drop-head"},
    )


def beat_router_exchange(name: str, namespace: str) -> ExchangeSpec:
    """Where the scheduler ``name``'s fires are routed: each task queue is bound here by its
    name (and a named exchange by its routing key), the journal by its own name (the ``BCC``)."""
    return ExchangeSpec(
        name=f"clockwork.beat.{scoped_name(namespace, name)}.router", type="direct", durable=True
    )


def beat_term_exchange(name: str, namespace: str, epoch: int) -> ExchangeSpec:
    """The one exchange the leader of term ``epoch`` fires through (bound to the router).

    The broker's fence: the next leader deletes it before reading the journal, so a publish from
    a leader that lost its term (frozen between its lease check and its publish) is refused (404)
    instead of firing a time the next leader fires too.
    """
    return ExchangeSpec(
        name=f"clockwork.beat.{scoped_name(namespace, name)}.term.{epoch}", type="fanout", durable=True
    )
