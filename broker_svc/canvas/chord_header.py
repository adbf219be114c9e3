"""A chord's header as the joiner counts it: one part per member, nested canvases included.

Celery lets a chord's header hold chains, groups and chords, nested; what reaches the body is one
value per member, and this module says which task leaves each member's part:

- a plain signature leaves its own;
- a chain leaves its last step's (a chain ending in a chord: that chord's body);
- a chord leaves its body's, once its own header has joined;
- a group directly in the header is unrolled into its members, in Celery's order (each nested
  group's members pushed to the front of what is left, so they come reversed), so each counts;
- a group that ends a chain is one member whose value is the list of its results, as on Celery's
  workers: it runs as a chord of its members with ``celery.accumulate`` as the body.

The member carries the chord's id, its index and the body (``options``: ``group_id``,
``group_index``, ``chord``), as Celery's client puts them on it; the task that leaves the part finds
them in its own message. Pure: maps in, maps out, no broker (the client and ``follow_ups`` send).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = ["ACCUMULATE", "MEMBERSHIP", "as_joined", "group_as_chord", "unrolled"]

ACCUMULATE: Final = "celery.accumulate"
# The options that make a signature's task leave a part of a chord: its id, the place, the body.
MEMBERSHIP: Final = ("group_id", "group_index", "chord")


def unrolled(members: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The header's members with each group replaced by its members, as Celery's client unrolls it.

    Celery's order: a group's members go to the front of what is left, last first, so a nested
    group's members come reversed (``[a, group(b, c)]`` is ``[a, c, b]``). Results reach the
    body in this order whichever client sent the chord.
    """
    stack: deque[Mapping[str, Any]] = deque(members)
    out: list[Mapping[str, Any]] = []
    while stack:
        member = stack.popleft()
        if member.get("subtask_type") == "group":
            stack.extendleft((member.get("kwargs") or {}).get("tasks") or ())
        else:
            out.append(member)
    return out


def as_joined(
    sig: Mapping[str, Any], *, group_id: str, index: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    """``sig`` (a header member, unrolled) made to leave part ``index`` of chord ``group_id``.

    ``body`` is the chord's body as its header tasks carry it (with ``chord_size``).
    """
    kind = sig.get("subtask_type")
    inner = sig.get("kwargs") or {}
    if kind == "chain":
        steps = list(inner.get("tasks") or ())
        if not steps:
            raise ValueError("an empty chain in a chord's header leaves no part")
        steps[-1] = as_joined(steps[-1], group_id=group_id, index=index, body=body)
        return {**sig, "kwargs": {**inner, "tasks": steps}}
    if kind == "chord":
        joined_body = as_joined(inner["body"], group_id=group_id, index=index, body=body)
        return {**sig, "kwargs": {**inner, "body": joined_body}}
    if kind == "group":
        return as_joined(group_as_chord(sig), group_id=group_id, index=index, body=body)
    options = {**(sig.get("options") or {}), "group_id": group_id, "group_index": index, "chord": body}
    return {**sig, "options": options}


def group_as_chord(sig: Mapping[str, Any]) -> dict[str, Any]:
    """A group whose results are one value: a chord of its members with ``celery.accumulate`` as body.

    A part-leaving group (Celery's client puts the chord on a group that ends a chain in a
    header) keeps that part on the accumulate body, which runs where the group's first member runs
    (else where the chord's body does).
    """
    options = dict(sig.get("options") or {})
    membership = {key: options.pop(key) for key in MEMBERSHIP if key in options}
    members = list((sig.get("kwargs") or {}).get("tasks") or ())
    queue = next((q for m in members if (q := (m.get("options") or {}).get("queue"))), None)
    outer = membership.get("chord")
    if queue is None and isinstance(outer, Mapping):
        queue = (outer.get("options") or {}).get("queue")
    body_options: dict[str, Any] = {**membership, **({"queue": queue} if queue else {})}
    accumulate: dict[str, Any] = {
        "task": ACCUMULATE, "args": [], "kwargs": {"index": 0}, "options": body_options,
        "subtask_type": None, "immutable": False,
    }  # fmt: skip
    kwargs = {"header": {**sig, "options": options}, "body": accumulate, "kwargs": {}}
    return {
        "task": "celery.chord", "args": [], "kwargs": kwargs, "options": {}, "subtask_type": "chord",
        "immutable": False,
    }  # fmt: skip
