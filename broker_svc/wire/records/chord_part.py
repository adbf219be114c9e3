"""A chord's part: what a finished header task tells the chord's joiner.

A header task of a chord carries the chord's body in its embed (``chord``) and the chord's id in
``group`` (docs/migrating-from-celery.md, "Chords, on RabbitMQ alone"). When it ends for good
(success, failure, revoked, refused), its worker publishes one part to the join queue, confirmed
before the header's delivery is acked. The joiner counts the parts of each chord by their index;
once every part is in, it sends the body with their results.

A part travels in the header's own content type (json or msgpack), so a result that reached the
header's caller reaches the body as well. It goes to the join queue of the app namespace that sent
the chord (``app_namespace`` on the body, beside ``chord_size``), whichever app's worker ran the
header: one chord's parts meet in one queue, even while an app moves to a namespace of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.errors import MessageError
from broker_svc.topology import app_namespace
from broker_svc.wire import codec

__all__ = [
    "NAMESPACE_KEY",
    "PART_CONTENT_TYPES",
    "ChordGrowth",
    "ChordPart",
    "decode_part",
    "encode_growth",
    "encode_part",
    "growth_map",
    "join_namespace",
]

PART_CONTENT_TYPES: Final = frozenset({codec.JSON, codec.MSGPACK})

# The chord body's key naming the app namespace of the chord's sender, whose joiner joins it.
NAMESPACE_KEY: Final = "app_namespace"


def join_namespace(body: Mapping[str, Any], default: str) -> str:
    """The app namespace whose joiner joins a chord: its sender's, carried on its body; else
    ``default`` (a chord from an older client, or a value that cannot name a queue)."""
    value = body.get(NAMESPACE_KEY)
    if isinstance(value, str):
        try:
            return app_namespace(value)
        except ValueError:
            pass
    return default


@dataclass(frozen=True, slots=True)
class ChordPart:
    """One header task's end, as the joiner needs it.

    Attributes:
        group_id: the chord's id (the header's group id).
        index: the header task's place in the header (its ``group_index``); parts are keyed by it.
        size: how many parts the chord has (the body's ``chord_size``).
        task_id: the header task's id.
        state: ``SUCCESS``, ``FAILURE`` or ``REVOKED``.
        result: the return value, or the exception map of a failure.
        body: the chord's body signature, as the header's embed carried it.
        reply_to: the header's result queue (the body's when its own options name none).
        root_id: the header's root id, passed on to the body.
    """

    group_id: str
    index: int
    size: int
    task_id: str
    state: str
    result: Any
    body: dict[str, Any]
    reply_to: str | None
    root_id: str | None

    @property
    def key(self) -> tuple[str, int]:
        """What makes a part unique: a redelivered header task sends the same key again."""
        return (self.group_id, self.index)


@dataclass(frozen=True, slots=True)
class ChordGrowth:
    """Tasks a header task added to its chord (Celery's ``self.add_to_chord``), told to the joiner.

    Published, confirmed, before the added tasks are sent, so it is in the join queue ahead of
    their parts and of its adder's part: the chord waits for them too. An added task carries its
    adder's ``group_index``; its part is told apart by its task id.

    Attributes:
        group_id: the chord's id.
        size: the chord's size as sent (the body's ``chord_size``).
        added: the ids of the tasks added.
    """

    group_id: str
    size: int
    added: tuple[str, ...]


def growth_map(growth: ChordGrowth) -> dict[str, Any]:
    """A growth record as the join queue carries it (``ChordBackend`` hands this map to kombu)."""
    return {"group_id": growth.group_id, "size": growth.size, "added": list(growth.added)}


def encode_growth(growth: ChordGrowth, content_type: str) -> tuple[bytes, str, str]:
    """``(body, content_type, content_encoding)`` of a growth record in ``content_type``."""
    return codec.encode(growth_map(growth), content_type)


def encode_part(part: ChordPart, content_type: str) -> tuple[bytes, str, str]:
    """``(body, content_type, content_encoding)`` of a part in ``content_type``.

    Raises:
        TypeError: the result holds what the codec cannot represent.
    """
    value = {
        "group_id": part.group_id,
        "index": part.index,
        "size": part.size,
        "task_id": part.task_id,
        "state": part.state,
        "result": part.result,
        "body": part.body,
        "reply_to": part.reply_to,
        "root_id": part.root_id,
    }
    return codec.encode(value, content_type)


def decode_part(body: bytes, content_type: str | None, *, max_bytes: int) -> ChordPart | ChordGrowth:
    """The part (or growth record) in a join-queue message.

    Raises:
        ValueError: the message is not a well-formed part, cannot be decoded or is too large.
    """
    try:
        value = codec.decode(body, content_type, accept=PART_CONTENT_TYPES, max_bytes=max_bytes)
    except MessageError as exc:  # undecodable, too large or of a refused type
        raise ValueError(str(exc)) from exc
    if not isinstance(value, Mapping):
        raise ValueError("a chord part must be a map")
    if "added" in value and "state" not in value:
        return _growth(value)
    group_id, index, size = value.get("group_id"), value.get("index"), value.get("size")
    task_id, state, sig = value.get("task_id"), value.get("state"), value.get("body")
    if not isinstance(group_id, str) or not group_id:
        raise ValueError("a chord part needs its chord's id (group_id)")
    if not isinstance(index, int) or not isinstance(size, int) or not _is_int(index) or not 0 <= index < size:
        raise ValueError(f"a chord part needs 0 <= index < size, got index={index!r} size={size!r}")
    if not isinstance(task_id, str) or state not in ("SUCCESS", "FAILURE", "REVOKED"):
        raise ValueError("a chord part needs a task_id and a final state")
    if not isinstance(sig, Mapping):
        raise ValueError("a chord part needs the chord's body signature")
    reply_to, root_id = value.get("reply_to"), value.get("root_id")
    return ChordPart(
        group_id=group_id,
        index=index,
        size=size,
        task_id=task_id,
        state=state,
        result=value.get("result"),
        body=dict(sig),
        reply_to=reply_to if isinstance(reply_to, str) else None,
        root_id=root_id if isinstance(root_id, str) else None,
    )


def _growth(value: Mapping[str, Any]) -> ChordGrowth:
    group_id, size, added = value.get("group_id"), value.get("size"), value.get("added")
    if (
        not isinstance(group_id, str)
        or not group_id
        or not isinstance(size, int)
        or not _is_int(size)
        or size < 1
    ):
        raise ValueError("a chord growth record needs its chord's id and size")
    if not isinstance(added, list) or not added or not all(isinstance(i, str) and i for i in added):
        raise ValueError("a chord growth record needs the added tasks' ids")
    return ChordGrowth(group_id=group_id, size=size, added=tuple(added))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
