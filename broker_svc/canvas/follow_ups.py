"""What a worker sends after a task, read from its message's embed (WIRE.md §3.3).

The next step of its chain, its callbacks, its errbacks, a chord step's header tasks: each a
``FollowUp`` ready to encode. ``unhonoured`` says, before a task runs, why its embed cannot be
honoured (so no part of a canvas is dropped in silence); ``runs_in_process`` which errbacks
Celery calls in the failed task's own process. Pure: no broker here (worker/consume/canvas.py
sends them).
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from broker_svc.canvas.chord_header import MEMBERSHIP, as_joined, group_as_chord, unrolled
from broker_svc.wire.ids import uuid4_str
from broker_svc.wire.task.stamps import message_stamps
from broker_svc.wire.task.task_message import TaskMessage, parse_iso_datetime

__all__ = [
    "FollowUp",
    "as_list",
    "chord_header_problem",
    "chord_members",
    "chords_for_groups",
    "follow_ups",
    "runs_in_process",
    "unhonoured",
]


def chord_members(sig: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], Mapping[str, Any]]:
    """A chord signature's header members and body, as maps (``sig`` must pass ``unhonoured``)."""
    inner = sig.get("kwargs") or {}
    header = inner.get("header")
    if isinstance(header, Mapping):
        header = (header.get("kwargs") or {}).get("tasks")
    return list(header or ()), inner["body"]


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A task a finished task's message asks for, ready to encode; ``queue`` None means route it."""

    message: TaskMessage
    queue: str | None


def unhonoured(embed: Mapping[str, Any], *, redis_chords: bool = False) -> str | None:
    """Why a message's embed cannot be honoured (before it runs), or None if it can.

    A malformed signature or a canvas shape Clockwork does not run yet is refused as a whole, so
    no part of it is silently dropped. A chord header's message must also carry its group id and
    index (``chord_header_problem``). ``redis_chords``: a chord without ``chord_size`` is counted
    in the worker's Redis result backend, as Celery's workers count it.
    """
    body = embed.get("chord")
    if body is not None:
        why = _unhonoured_signature(body)
        if why is not None:
            return f"embed 'chord' (the chord's body): {why}"
        size = body.get("chord_size")
        if size is None and redis_chords:
            pass  # counted in Redis: the client set the size there
        elif not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return (
                "embed 'chord' carries no chord_size: the chord was sent by a client whose result "
                "backend counts chords itself; send it with Clockwork's client or with "
                "Celery's backend='broker_svc.celery_backend:ChordBackend', or give the worker's "
                "app that client's Redis result backend"
            )
    for field_name in ("callbacks", "errbacks", "chain"):
        value = embed.get(field_name)
        if value is None:
            continue
        if not isinstance(value, list | tuple):
            return f"embed {field_name!r} must be a list of signatures"
        for sig in value:
            why = _unhonoured_signature(sig)
            if why is not None:
                return f"embed {field_name!r}: {why}"
    steps = embed.get("chain") or []
    # Celery stores a chain last step first, and turns a group followed by a step into a chord.
    if any(isinstance(s, Mapping) and s.get("subtask_type") == "group" for s in list(steps)[1:]):
        return "a group followed by more steps in a chain must be sent as a chord"
    return None


def chord_header_problem(
    embed: Mapping[str, Any], group_id: str | None, group_index: int | None
) -> str | None:
    """Why a chord header's message cannot take part in its chord, or None (or not a header)."""
    body = embed.get("chord")
    if body is None:
        return None
    if not group_id:
        return "a chord's header task needs its chord's id (header 'group')"
    size = body.get("chord_size")
    if size is None:
        return None  # counted in Redis (``unhonoured`` refused it otherwise): any index
    if group_index is None or not 0 <= group_index < size:
        return f"a chord's header task needs its place, 0 <= group_index < {size}, got {group_index!r}"
    return None


def _unhonoured_signature(sig: Any, depth: int = 0) -> str | None:
    if not isinstance(sig, Mapping):
        return f"a signature must be a map, got {type(sig).__name__}"
    if depth > 8:
        return "signatures nest too deep"
    kind = sig.get("subtask_type")
    if kind not in (None, "chain", "group", "chord"):
        return f"subtask_type {kind!r} is not supported"
    kwargs = sig.get("kwargs") or {}
    if kind == "chord":
        return _unhonoured_chord(kwargs, depth)
    if kind in ("chain", "group"):
        tasks = kwargs.get("tasks") if isinstance(kwargs, Mapping) else None
        if not isinstance(tasks, list | tuple) or not tasks:
            return f"a {kind} signature needs kwargs.tasks"
        for inner in tasks:
            why = _unhonoured_signature(inner, depth + 1)
            if why is not None:
                return why
        return None
    if not isinstance(sig.get("task"), str) or not sig.get("task"):
        return "a signature needs a task name"
    if not isinstance(sig.get("args") or [], list | tuple) or not isinstance(kwargs, Mapping):
        return "a signature's args must be a list and its kwargs a map"
    options = sig.get("options") or {}
    if not isinstance(options, Mapping):
        return "a signature's options must be a map"
    try:
        message_stamps(options)
    except TypeError as exc:
        return str(exc)
    exchange = options.get("exchange")
    if exchange not in (None, "", options.get("queue"), options.get("routing_key")):
        # The worker sends follow-ups to a queue by name; a routing through another exchange would
        # be dropped in silence if it were simply ignored.
        return f"a follow-up sent through exchange {exchange!r} is not supported; give it a queue"
    for key in ("link", "link_error"):
        for inner in as_list(options.get(key)):
            why = _unhonoured_signature(inner, depth + 1)
            if why is not None:
                return why
    return None


def _unhonoured_chord(kwargs: Any, depth: int) -> str | None:
    if not isinstance(kwargs, Mapping) or not isinstance(kwargs.get("body"), Mapping):
        return "a chord signature needs kwargs.body"
    header = kwargs.get("header")
    if isinstance(header, Mapping):
        header = (header.get("kwargs") or {}).get("tasks") if header.get("subtask_type") == "group" else None
    if not isinstance(header, list | tuple):
        return "a chord signature needs kwargs.header (a group or a list of signatures)"
    for member in header:
        why = _unhonoured_signature(member, depth + 1)
        if why is not None:
            return why
    return _unhonoured_signature(kwargs["body"], depth + 1)


def follow_ups(
    sig: Mapping[str, Any],
    *,
    parent: TaskMessage,
    partial: Sequence[Any],
    chain_rest: Sequence[Mapping[str, Any]] | None = None,
) -> list[FollowUp]:
    """The messages that run ``sig`` after ``parent``, with ``partial`` before its own arguments.

    A plain signature is one message (carrying ``chain_rest`` as its chain); a group is one per
    member, with the group's id and each member's index; a chain is its first step carrying the
    rest. ``sig`` must have passed ``unhonoured``.
    """
    kind = sig.get("subtask_type")
    inner = sig.get("kwargs") or {}
    if kind == "chord":
        return _chord_follow_ups(sig, parent=parent, partial=partial, chain_rest=chain_rest)
    if kind == "group":
        options = sig.get("options") or {}
        outer = options.get("chord")
        if isinstance(outer, Mapping) and outer.get("chord_size") is not None:
            # Ends a chain in a chord's header: its results are one part (chord_header.py).
            as_chord = group_as_chord(sig)
            return _chord_follow_ups(as_chord, parent=parent, partial=partial, chain_rest=chain_rest)
        group_id = options.get("group_id") or options.get("task_id") or uuid4_str()
        # A chord counted in Redis counts each member, as Celery's workers send them: the client
        # sized it so and saved the header's shape, which gives the group's values as one list.
        counted = {"chord": outer} if outer is not None else {}
        members = list(inner.get("tasks") or ())
        out: list[FollowUp] = []
        for index, member in enumerate(members):
            fixed = {**member, "options": {**(member.get("options") or {}), "group_id": group_id,
                                            "group_index": index, **counted}}  # fmt: skip
            out.extend(follow_ups(fixed, parent=parent, partial=partial))
        return out
    if kind == "chain":
        steps = chords_for_groups(list(inner.get("tasks") or ()))
        # Stored last step first: the outer chain's rest runs after this chain's own steps.
        rest = [*(chain_rest or ()), *reversed(steps[1:])]
        return follow_ups(steps[0], parent=parent, partial=partial, chain_rest=rest)
    return [_follow_up(sig, parent=parent, partial=partial, chain_rest=chain_rest)]


def _chord_follow_ups(
    sig: Mapping[str, Any],
    *,
    parent: TaskMessage,
    partial: Sequence[Any],
    chain_rest: Sequence[Mapping[str, Any]] | None,
) -> list[FollowUp]:
    # A chord as a step (Celery's chain of a group and a step): its header's members, each made to
    # leave its part (chord_header.py) and carrying the body with the chord's size; the steps after
    # it run after its body.
    members, body = chord_members(sig)
    members = unrolled(members)
    options = dict(sig.get("options") or {})
    body_options = {**(body.get("options") or {})}
    if options.get("chord") is not None:
        # The chord is itself a part of an outer chord: its body leaves that part.
        outer = {key: options.pop(key) for key in MEMBERSHIP if key in options}
        if body_options.get("chord") is None:
            body_options.update(outer)
    header = (sig.get("kwargs") or {}).get("header")
    header_options = (header.get("options") or {}) if isinstance(header, Mapping) else {}
    group_id = options.get("group_id") or header_options.get("task_id") or uuid4_str()
    body_options.setdefault("task_id", options.get("task_id") or uuid4_str())
    body_options.setdefault("reply_to", options.get("reply_to") or parent.reply_to)
    if chain_rest:
        body_options["chain"] = list(chain_rest)
    if not members:
        return follow_ups({**body, "options": body_options}, parent=parent, partial=([],))
    carried = {**body, "options": body_options, "chord_size": len(members)}
    out: list[FollowUp] = []
    for index, member in enumerate(members):
        joined = as_joined(member, group_id=group_id, index=index, body=carried)
        out.extend(follow_ups(joined, parent=parent, partial=partial))
    return out


def chords_for_groups(steps: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """A chain's steps by Celery's rule: a group followed by another step is a chord with that step
    as its body (maps in; the client's ``chain`` passes its signatures through it too)."""
    out: list[Mapping[str, Any]] = []
    index = 0
    while index < len(steps):
        step = steps[index]
        if step.get("subtask_type") == "group" and index + 1 < len(steps):
            header = {**step}
            out.append({
                "task": "celery.chord", "args": [], "kwargs": {"header": header, "body": steps[index + 1],
                "kwargs": {}}, "options": {}, "subtask_type": "chord", "immutable": False,
            })  # fmt: skip
            index += 2
        else:
            out.append(step)
            index += 1
    return out


def _follow_up(
    sig: Mapping[str, Any],
    *,
    parent: TaskMessage,
    partial: Sequence[Any],
    chain_rest: Sequence[Mapping[str, Any]] | None,
) -> FollowUp:
    options: Mapping[str, Any] = sig.get("options") or {}
    immutable = bool(sig.get("immutable"))
    args = list(sig.get("args") or ())
    if not immutable:
        args = [*partial, *args]
    task_id = options.get("task_id") or uuid4_str()
    eta = _when(options.get("eta"), options.get("countdown"))
    raw_expires = options.get("expires")
    numeric = isinstance(raw_expires, int | float) and not isinstance(raw_expires, bool)
    expires = _when(None if numeric else raw_expires, raw_expires if numeric else None)
    # It keeps the stamps its signature was given, as Celery's worker sends it.
    stamped_headers, stamps = message_stamps(options)
    message = TaskMessage(
        id=task_id,
        task=str(sig["task"]),
        args=args,
        kwargs=dict(sig.get("kwargs") or {}),
        embed={
            "callbacks": as_list(options.get("link")) or None,
            "errbacks": as_list(options.get("link_error")) or None,
            "chain": list(chain_rest or options.get("chain") or ()) or None,
            "chord": options.get("chord"),
        },
        root_id=parent.root_id or parent.id,
        parent_id=parent.id,
        group=options.get("group_id"),
        group_index=options.get("group_index"),
        eta=eta,
        expires=expires,
        timelimit=(options.get("time_limit"), options.get("soft_time_limit")),
        ignore_result=bool(options.get("ignore_result", False)),
        shadow=options.get("shadow"),
        reply_to=options.get("reply_to") or parent.reply_to,
        correlation_id=task_id,
        priority=options.get("priority"),
        content_type=parent.content_type,
        extra_headers=dict(options.get("headers") or {}),
        replaced_task_nesting=int(options.get("replaced_task_nesting") or 0),
        stamped_headers=stamped_headers,
        stamps=stamps,
    )
    queue = options.get("queue") or options.get("routing_key")
    return FollowUp(message, queue if isinstance(queue, str) and queue else None)


def as_list(value: Any) -> list[Any]:
    """A value or list of values (a ``link`` option, say) as a list."""
    if not value:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _when(at: Any, seconds: Any) -> dt.datetime | None:
    if isinstance(seconds, int | float) and not isinstance(seconds, bool):
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=float(seconds))
    if isinstance(at, dt.datetime):
        return at if at.tzinfo else at.replace(tzinfo=dt.UTC)
    if isinstance(at, str):
        try:
            return parse_iso_datetime(at)
        except ValueError:
            return None
    return None


class _TaskOptions(Protocol):
    @property
    def bind(self) -> bool: ...


class TaskLookup(Protocol):
    """What ``runs_in_process`` reads of an app (``App``): its tasks by name."""

    @property
    def tasks(self) -> Mapping[str, _TaskOptions]: ...


def runs_in_process(app: TaskLookup, errback: Mapping[str, Any]) -> bool:
    """A new-style errback: a task of this app whose body takes (request, exc, traceback).

    Celery calls such an errback in the failed task's process rather than sending it; the pool
    child does the same (worker/child/run.py). Any other errback is sent as a task with the
    failed task's id.
    """
    task = app.tasks.get(str(errback.get("task") or ""))
    function = getattr(type(task), "__wrapped__", None) if task is not None else None
    if function is None:
        return False
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    if task is not None and task.bind:
        return False  # Celery sends bound errbacks as tasks, so they can retry
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in parameters)
    # As Celery's arity check: any *args, or more than one parameter its own arguments leave free.
    return has_varargs or len(positional) - len(errback.get("args") or ()) > 1
