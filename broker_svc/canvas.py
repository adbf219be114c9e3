"""The canvas: signatures, chains and groups, sent as Celery's client sends them.

A ``Signature`` is a task call not sent yet, and a map with Celery's keys (``task``, ``args``,
``kwargs``, ``options``, ``subtask_type``, ``immutable``), so it travels inside a task message as
it is: as a ``link``/``link_error`` callback, or as a step of a chain. The worker runs what follows
(worker/consume/canvas.py): the next step of a chain with the parent's result, the callbacks after
a success, the errbacks after a failure.

- ``chain(a, b, c)`` (or ``a | b | c``) sends ``a`` with ``b`` and ``c`` in its ``chain`` field
  (last step first, as Celery stores it); every step has its id and this client's reply queue, so
  each step's result comes back here; the call returns the last step's result, whose ``parent``
  is the one before.
- ``group(a, b, c)`` sends each with the group's id and its index, in one hand-over to the
  connection, and returns a ``GroupResult``.
- ``task.map(it)``, ``task.starmap(it)`` and ``task.chunks(it, n)`` are Celery's built-in tasks
  ``celery.map``, ``celery.starmap`` and (as a group of starmaps) ``celery.chunks``.

Chords need a result store that counts the header's results; they are not built yet, and a group
followed by another step (which Celery turns into a chord) is refused with an error saying so.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from broker_svc.wire.ids import uuid4_str
from broker_svc.wire.task_message import TaskMessage, parse_iso_datetime

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.group_result import GroupResult
    from broker_svc.result import AsyncResult

__all__ = [
    "FollowUp",
    "Signature",
    "chain",
    "chunks",
    "follow_ups",
    "group",
    "maybe_signature",
    "runs_in_process",
    "signature",
    "unhonoured",
    "xmap",
    "xstarmap",
]

_CHORD_REFUSED: Final = (
    "a group followed by another step is a chord, and chords are not built yet (they need a "
    "result store that counts the group's results); send the group and the next step yourself"
)


class Signature(dict[str, Any]):
    """One task call not sent yet (``add.s(2, 2)``), with Celery's map keys and methods.

    Args:
        task: the task name (or a map with Celery's signature keys).
        args: positional arguments; more given when it is sent go before these (a partial).
        kwargs: keyword arguments; more given when it is sent are merged in.
        options: send options (``queue``, ``countdown``, ``link``, ...).
        immutable: ignore the parent's result and partial arguments (``add.si(2, 2)``).
        subtask_type: ``None``, or ``"chain"``/``"group"`` for those.
        app: the app that sends it (default: the task's app, else the current app).
    """

    def __init__(
        self,
        task: str | Mapping[str, Any] = "",
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        *,
        immutable: bool = False,
        subtask_type: str | None = None,
        app: App | None = None,
        **more_options: Any,
    ) -> None:
        if not isinstance(task, str):  # a map (cheaper to test than isinstance(task, Mapping))
            source = task
            task = str(source.get("task", ""))
            args = source.get("args") or ()
            kwargs = source.get("kwargs") or {}
            options = source.get("options") or {}
            immutable = bool(source.get("immutable", False))
            subtask_type = source.get("subtask_type")
        super().__init__(
            task=task,
            args=tuple(args or ()),
            kwargs=dict(kwargs or {}),
            options={**dict(options or {}), **more_options},
            subtask_type=subtask_type,
            immutable=immutable,
        )
        self._app = app

    # -- Celery's attributes ------------------------------------------------------------------------

    @property
    def task(self) -> str:
        name: str = self["task"]
        return name

    @property
    def args(self) -> tuple[Any, ...]:
        args: tuple[Any, ...] = self["args"]
        return args

    @property
    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = self["kwargs"]
        return kwargs

    @property
    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = self["options"]
        return options

    @property
    def immutable(self) -> bool:
        return bool(self["immutable"])

    @property
    def subtask_type(self) -> str | None:
        kind: str | None = self["subtask_type"]
        return kind

    @property
    def id(self) -> str | None:
        """The task id, once frozen or given as ``task_id``."""
        task_id: str | None = self.options.get("task_id")
        return task_id

    @property
    def app(self) -> App:
        """The app that sends this signature."""
        if self._app is not None:
            return self._app
        from broker_svc.shared import current_app  # at call time: shared imports task, which imports us

        return current_app()

    def __repr__(self) -> str:
        shown = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.task}({', '.join(shown)}){'!' if self.immutable else ''}"

    # -- building ---------------------------------------------------------------------------------

    def clone(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Signature:
        """A copy, with partial arguments (before its own) and options merged in."""
        new_args, new_kwargs = self._partial(args, kwargs)
        return Signature(
            self.task, new_args, new_kwargs, {**self.options, **options}, immutable=self.immutable,
            subtask_type=self.subtask_type, app=self._app,
        )  # fmt: skip

    partial = clone

    def set(self, immutable: bool | None = None, **options: Any) -> Signature:
        """Set send options (and immutability) on this signature; returns it, as Celery's does."""
        if immutable is not None:
            self["immutable"] = immutable
        self.options.update(options)
        return self

    def link(self, callback: Signature) -> Signature:
        """Run ``callback`` with this task's result after it succeeds; returns the callback."""
        self.options.setdefault("link", []).append(callback)
        return callback

    def link_error(self, errback: Signature) -> Signature:
        """Run ``errback`` with this task's id after it fails for good; returns the errback."""
        self.options.setdefault("link_error", []).append(errback)
        return errback

    def on_error(self, errback: Signature) -> Signature:
        """``link_error``, returning this signature (Celery's chaining form)."""
        self.link_error(errback)
        return self

    def freeze(self, _id: str | None = None, **fields: Any) -> AsyncResult:
        """Give it its task id and this client's reply queue now; the result it will have."""
        task_id = self.options.setdefault("task_id", _id or uuid4_str())
        for key, value in fields.items():
            if value is not None:
                self.options.setdefault(key, value)
        self.options.setdefault("reply_to", self.app.reply_queue)
        return self.app.AsyncResult(task_id)

    def __or__(self, other: Signature) -> Signature:  # type: ignore[override]  # Celery's chain operator
        if not isinstance(other, Signature):
            return NotImplemented
        return chain(*_steps_of(self), *_steps_of(other), app=self._app)

    # -- sending ----------------------------------------------------------------------------------

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult | GroupResult:
        """Send it with these partial arguments."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> AsyncResult | GroupResult:
        """Send it, with partial arguments and send options merged in.

        Raises:
            TypeError: an unknown send option.
            PublishError: (``confirm="each"``) the broker did not confirm it.
        """
        new_args, new_kwargs = self._partial(args, kwargs)
        return self.app.send_task(self.task, new_args, new_kwargs, **{**self.options, **options})

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any:
        """Run it here, now (``Task.apply``); an ``EagerResult``.

        Raises:
            NotRegistered: the app has no task of this name.
        """
        new_args, new_kwargs = self._partial(args, kwargs)
        return self.app.get_task(self.task).apply(new_args, new_kwargs, **{**self.options, **options})

    def as_wire(self) -> dict[str, Any]:
        """A plain map for a task message: nested signatures as maps, args as a list."""
        options = {k: _wire_value(v) for k, v in self.options.items()}
        return {
            "task": self.task,
            "args": [_wire_value(a) for a in self.args],
            "kwargs": {k: _wire_value(v) for k, v in self.kwargs.items()},
            "options": options,
            "subtask_type": self.subtask_type,
            "immutable": self.immutable,
        }

    def _partial(
        self, args: Sequence[Any] | None, kwargs: Mapping[str, Any] | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.immutable:
            return self.args, dict(self.kwargs)
        return tuple(args or ()) + self.args, {**self.kwargs, **(kwargs or {})}


class chain(Signature):
    """Steps run one after another, each given the one before's result (``a | b | c``)."""

    def __init__(
        self, *tasks: Signature | Iterable[Signature], app: App | None = None, **options: Any
    ) -> None:
        steps: list[Signature] = []
        for item in tasks:
            if isinstance(item, Signature):
                steps.extend(_steps_of(item))
            else:
                steps.extend(s for i in item for s in _steps_of(maybe_signature(i)))
        if app is None:
            app = next((s._app for s in steps if s._app is not None), None)
        super().__init__("celery.chain", (), {"tasks": steps}, options, subtask_type="chain", app=app)

    @property
    def tasks(self) -> list[Signature]:
        steps: list[Signature] = self.kwargs["tasks"]
        return steps

    def clone(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> chain:
        copy = chain(*(s.clone() for s in self.tasks), app=self._app, **{**self.options, **options})
        if args and copy.tasks:
            copy.tasks[0] = copy.tasks[0].clone(args)
        return copy

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> AsyncResult | GroupResult:
        """Send the first step, carrying the rest; the last step's result (``.parent``: the one before).

        Raises:
            ValueError: an empty chain, or a group followed by another step (a chord).
        """
        steps = [step.clone() for step in self.tasks]
        if not steps:
            raise ValueError("an empty chain has nothing to send")
        if len(steps) == 1:
            return steps[0].apply_async(args, kwargs, **{**self.options, **options})
        if any(step.subtask_type == "group" for step in steps[:-1]):
            raise ValueError(_CHORD_REFUSED)
        if steps[-1].subtask_type == "group":
            raise ValueError("a group as the last step of a chain is not supported yet; link it instead")
        app = self._app or steps[0].app
        for step in steps:
            step._app = step._app or app
        options = {**self.options, **options}
        last_id = options.pop("task_id", None)
        first = steps[0].clone(args, kwargs)
        root_id = first.options.get("task_id") or uuid4_str()
        first.options["task_id"] = root_id
        results: list[AsyncResult] = []
        # Results are registered before anything is sent: a fast step's result finds its waiter.
        for index, step in enumerate(steps[1:], start=1):
            results.append(step.freeze(last_id if index == len(steps) - 1 else None, root_id=root_id))
        rest = [step.as_wire() for step in reversed(steps[1:])]
        previous: Any = first.apply_async(chain=rest, **options)
        for result in results:
            result.parent = previous
            previous = result
        return results[-1]

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any:
        """Run every step here, each given the one before's value; the last step's ``EagerResult``."""
        result: Any = None
        for index, step in enumerate(self.tasks):
            if index == 0:
                result = step.apply(args, kwargs, **options)
            else:
                result = step.apply((result.get(),), **options)
        return result


class group(Signature):
    """Tasks sent together, run in parallel, collected as one ``GroupResult``."""

    def __init__(
        self, *tasks: Signature | Iterable[Signature], app: App | None = None, **options: Any
    ) -> None:
        members: list[Signature] = []
        for item in tasks:
            if isinstance(item, Signature):
                members.append(item)
            else:
                members.extend(maybe_signature(i) for i in item)
        if app is None:
            app = next((s._app for s in members if s._app is not None), None)
        super().__init__("celery.group", (), {"tasks": members}, options, subtask_type="group", app=app)

    @property
    def tasks(self) -> list[Signature]:
        members: list[Signature] = self.kwargs["tasks"]
        return members

    def __or__(self, other: Signature) -> Signature:  # type: ignore[override]  # Celery's chord operator
        raise ValueError(_CHORD_REFUSED)

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        """Run every member here, one after another; their results as one."""
        from broker_svc.group_result import GroupResult

        group_id = options.pop("group_id", None) or uuid4_str()
        return GroupResult(group_id, [member.apply(args, kwargs, **options) for member in self.tasks])

    def clone(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> group:
        members = (member.clone(args, kwargs) for member in self.tasks)
        return group(members, app=self._app, **{**self.options, **options})

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        """Send every member with the group's id and its index; their results as one.

        Raises:
            PublishError: (``confirm="each"``) the broker did not confirm one of them.
        """
        from broker_svc.group_result import GroupResult  # result types import the app

        options = {**self.options, **options}
        group_id = options.pop("group_id", None) or options.pop("task_id", None) or uuid4_str()
        app = self._app or (self.tasks[0].app if self.tasks else None)
        if app is None:
            return GroupResult(group_id, [])
        plain: list[tuple[int, Signature]] = []
        results: list[AsyncResult | GroupResult | None] = []
        for index, member in enumerate(self.tasks):
            step_options = {**options, "group_id": group_id, "group_index": index}
            if member.subtask_type is None:
                new_args, new_kwargs = member._partial(args, kwargs)
                merged = {**member.options, **step_options}
                plain.append((index, Signature(member.task, new_args, new_kwargs, merged)))
                results.append(None)
            else:
                results.append(member.clone(args, kwargs).apply_async(**step_options))
        for (index, _), result in zip(plain, app.send_many(s for _, s in plain), strict=True):
            results[index] = result
        return GroupResult(group_id, [r for r in results if r is not None], app=app)


class xmap(Signature):
    """``task.map(it)``: one task that calls ``task(item)`` for each item (Celery's ``celery.map``)."""

    task_name = "celery.map"

    def __init__(self, task: Signature, it: Iterable[Any], **options: Any) -> None:
        super().__init__(
            self.task_name, (), {"task": task.as_wire(), "it": list(it)}, options, immutable=True,
            app=task._app,
        )  # fmt: skip


class xstarmap(xmap):
    """``task.starmap(it)``: one task that calls ``task(*item)`` for each item (``celery.starmap``)."""

    task_name = "celery.starmap"


class chunks(Signature):
    """``task.chunks(it, n)``: the items in parts of ``n``, each part one ``starmap`` task, as a group."""

    def __init__(self, task: Signature, it: Iterable[Any], n: int, **options: Any) -> None:
        if n < 1:
            raise ValueError(f"chunk size must be at least 1, got {n}")
        super().__init__(
            "celery.chunks", (), {"task": task.as_wire(), "it": list(it), "n": n}, options, immutable=True,
            app=task._app,
        )  # fmt: skip
        self._task = task

    def group(self) -> group:
        """The group of ``starmap`` tasks this sends."""
        items, n = self.kwargs["it"], int(self.kwargs["n"])
        parts = [items[i : i + n] for i in range(0, len(items), n)]
        return group((xstarmap(self._task, part) for part in parts), app=self._app)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        return self.group().apply_async(**{**self.options, **options})


def signature(task: str | Mapping[str, Any], *args: Any, **kwargs: Any) -> Signature:
    """A signature from a name (Celery's ``signature('tasks.add', args=(2, 2))``) or a map."""
    if isinstance(task, Mapping):
        return maybe_signature(task)
    return Signature(task, *args, **kwargs)


def maybe_signature(value: Signature | Mapping[str, Any]) -> Signature:
    """``value`` as a signature of the right kind (a chain's or group's map becomes one)."""
    if isinstance(value, Signature):
        return value
    kind = value.get("subtask_type")
    inner = value.get("kwargs") or {}
    options = dict(value.get("options") or {})
    if kind == "chain":
        return chain(*(maybe_signature(s) for s in inner.get("tasks", ())), **options)
    if kind == "group":
        return group(*(maybe_signature(s) for s in inner.get("tasks", ())), **options)
    return Signature(value)


def _steps_of(sig: Signature) -> list[Signature]:
    return list(sig.tasks) if isinstance(sig, chain) else [sig]


def _wire_value(value: Any) -> Any:
    if isinstance(value, Signature):
        return value.as_wire()
    if isinstance(value, list | tuple):
        return [_wire_value(v) for v in value]
    return value


# -- what a worker sends after a task: the next step of its chain, its callbacks, its errbacks ---------


@dataclass(frozen=True, slots=True)
class FollowUp:
    """A task a finished task's message asks for, ready to encode; ``queue`` None means route it."""

    message: TaskMessage
    queue: str | None


def unhonoured(embed: Mapping[str, Any]) -> str | None:
    """Why a message's embed cannot be honoured (before it runs), or None if it can.

    A chord, a malformed signature or a canvas shape Clockwork does not run yet is refused as a
    whole, so no part of it is silently dropped.
    """
    if embed.get("chord"):
        return "the message is a chord's header (embed 'chord'); chords are not supported yet"
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
    # Celery stores a chain last step first: a group anywhere but the last step to run is a chord.
    if any(isinstance(s, Mapping) and s.get("subtask_type") == "group" for s in list(steps)[1:]):
        return "a group followed by more steps is a chord; chords are not supported yet"
    return None


def _unhonoured_signature(sig: Any, depth: int = 0) -> str | None:
    if not isinstance(sig, Mapping):
        return f"a signature must be a map, got {type(sig).__name__}"
    if depth > 8:
        return "signatures nest too deep"
    kind = sig.get("subtask_type")
    if kind not in (None, "chain", "group"):
        return f"subtask_type {kind!r} is not supported (chords are not built yet)"
    kwargs = sig.get("kwargs") or {}
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
    for key in ("link", "link_error"):
        for inner in _as_list(options.get(key)):
            why = _unhonoured_signature(inner, depth + 1)
            if why is not None:
                return why
    return None


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
    if kind == "group":
        options = sig.get("options") or {}
        group_id = options.get("group_id") or options.get("task_id") or uuid4_str()
        members = list(inner.get("tasks") or ())
        out: list[FollowUp] = []
        for index, member in enumerate(members):
            fixed = {**member, "options": {**(member.get("options") or {}), "group_id": group_id,
                                            "group_index": index}}  # fmt: skip
            out.extend(follow_ups(fixed, parent=parent, partial=partial))
        return out
    if kind == "chain":
        steps = list(inner.get("tasks") or ())
        # Stored last step first: the outer chain's rest runs after this chain's own steps.
        rest = [*(chain_rest or ()), *reversed(steps[1:])]
        return follow_ups(steps[0], parent=parent, partial=partial, chain_rest=rest)
    return [_follow_up(sig, parent=parent, partial=partial, chain_rest=chain_rest)]


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
    message = TaskMessage(
        id=task_id,
        task=str(sig["task"]),
        args=args,
        kwargs=dict(sig.get("kwargs") or {}),
        embed={
            "callbacks": _as_list(options.get("link")) or None,
            "errbacks": _as_list(options.get("link_error")) or None,
            "chain": list(chain_rest) if chain_rest else None,
            "chord": None,
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
    )
    queue = options.get("queue") or options.get("routing_key")
    return FollowUp(message, queue if isinstance(queue, str) and queue else None)


def _as_list(value: Any) -> list[Any]:
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


def runs_in_process(app: App, errback: Mapping[str, Any]) -> bool:
    """A new-style errback: a task of this app whose body takes (request, exc, traceback).

    Celery calls such an errback in the failed task's process rather than sending it; the pool
    child does the same (worker/pool/child.py). Any other errback is sent as a task with the
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
