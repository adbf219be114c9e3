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

- ``chord(header, body)`` (or ``group(...) | body``, or a group followed by more steps in a chain)
  sends the header's tasks, each carrying the body (with the chord's size) in its ``chord`` field;
  their workers leave each header task's end with the chord's joiner, which sends the body with
  the header's results once all are in (worker/consume/chord_join.py). The call returns the
  body's result, whose ``parent`` is the header's ``GroupResult``.
"""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from broker_svc.routes import route_for
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
    "chord",
    "chord_header_problem",
    "chord_members",
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

_NESTED_HEADER: Final = (
    "a chord's header holds plain task signatures only; a group, chain or chord inside a chord's "
    "header is not supported yet"
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
            ValueError: an empty chain, a group as its last step, or a chord with a nested header.
        """
        steps = _upgrade_to_chords([step.clone() for step in self.tasks])
        if not steps:
            raise ValueError("an empty chain has nothing to send")
        if len(steps) == 1:
            return steps[0].apply_async(args, kwargs, **{**self.options, **options})
        if steps[-1].subtask_type == "group":
            raise ValueError("a group as the last step of a chain is not supported yet; link it instead")
        app = self._app or steps[0].app
        for step in steps:
            step._app = step._app or app
        options = {**self.options, **options}
        last_id = options.pop("task_id", None)
        first = steps[0].clone(args, kwargs)
        if isinstance(first, chord):
            root_id = uuid4_str()  # a chord's task_id is its body's
        else:
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
        if not isinstance(other, Signature):
            return NotImplemented
        if isinstance(other, chain):
            return chain(chord(self, other.tasks[0], app=self._app), *other.tasks[1:], app=self._app)
        return chord(self, other, app=self._app)

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


class chord(Signature):
    """A header of tasks run in parallel, then ``body`` once with the list of their results.

    ``chord(header)(body)``, ``chord(header, body).apply_async()`` and ``group(...) | body`` all
    send it. The header's results are counted in the broker (worker/consume/chord_join.py): no
    result store, no polling. If a header task fails, the body does not run and its result is a
    ``ChordError`` naming the failed task.
    """

    def __init__(
        self,
        header: Signature | Iterable[Signature],
        body: Signature | None = None,
        *,
        app: App | None = None,
        **options: Any,
    ) -> None:
        if isinstance(header, group):
            members = list(header.tasks)
        elif isinstance(header, Signature):
            members = [header]
        else:
            members = [maybe_signature(item) for item in header]
        if app is None:
            candidates = [*members, *([body] if body is not None else [])]
            app = next((s._app for s in candidates if s._app is not None), None)
        super().__init__(
            "celery.chord", (), {"header": group(members, app=app), "body": body, "kwargs": {}}, options,
            subtask_type="chord", app=app,
        )  # fmt: skip

    @property
    def tasks(self) -> list[Signature]:
        """The header's task signatures."""
        header: group = self.kwargs["header"]
        return header.tasks

    @property
    def body(self) -> Signature | None:
        """What runs once with the header's results."""
        body: Signature | None = self.kwargs["body"]
        return body

    def clone(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> chord:
        members = [member.clone(args, kwargs) for member in self.tasks]
        body = self.body.clone() if self.body is not None else None
        return chord(members, body, app=self._app, **{**self.options, **options})

    def __call__(self, body: Signature | None = None, **options: Any) -> AsyncResult:
        """Send it with ``body`` (Celery's ``chord(header)(body)``); the body's result."""
        return self.apply_async(body=body, **options)

    def freeze(self, _id: str | None = None, **fields: Any) -> AsyncResult:
        """Give the body its id (``_id``) and the chord its group id; the body's result."""
        body = self._body_or_raise()
        self.options.setdefault("group_id", uuid4_str())
        fields.pop("group_id", None)
        return body.freeze(_id, **fields)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        body: Signature | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Send the header's tasks, each carrying the body; the body's result (``.parent``: the header's).

        ``args``/``kwargs`` are partial arguments for every header task. ``task_id`` is the body's
        id. A chord with an empty header sends its body at once, with an empty list.

        Raises:
            ValueError: no body, or a header holding groups, chains or chords.
            PublishError: (``confirm="each"``) the broker did not confirm a header task.
        """
        from broker_svc.group_result import GroupResult  # result types import the app

        body = (body or self._body_or_raise()).clone()
        members = self.tasks
        if any(member.subtask_type is not None for member in members):
            raise ValueError(_NESTED_HEADER)
        options = {**self.options, **options}
        group_id = options.pop("group_id", None) or uuid4_str()
        body_id = options.pop("task_id", None) or body.id
        rest = options.pop("chain", None)
        app = self._app or body.app
        body._app = body._app or app
        if rest:
            body.options["chain"] = rest  # the steps after the chord run after its body
        if body.subtask_type is None and "queue" not in body.options:
            # Routed here, as its header is: any worker of the cluster may be the one that sends it.
            routed = route_for(app.conf.get("task_routes"), body.task, body.args, body.kwargs, body.options)
            body.options["queue"] = routed.get("queue") or app.settings.default_queue
        result = body.freeze(body_id, group_id=group_id)
        if not members:
            body.apply_async(([],), **options)
            result.parent = GroupResult(group_id, [], app=app)
            return result
        carried = {**body.as_wire(), "chord_size": len(members)}
        sent: list[Signature] = []
        for index, member in enumerate(members):
            new_args, new_kwargs = member._partial(args, kwargs)
            step = {**member.options, **options, "group_id": group_id, "group_index": index, "chord": carried}
            sent.append(Signature(member.task, new_args, new_kwargs, step))
        result.parent = GroupResult(group_id, app.send_many(sent), app=app)
        return result

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any:
        """Run the header here, then the body with its values; the body's ``EagerResult``."""
        header = group(self.tasks, app=self._app).apply(args, kwargs)
        return self._body_or_raise().apply((header.get(),), **options)

    def _body_or_raise(self) -> Signature:
        if self.body is None:
            raise ValueError("a chord needs a body: chord(header)(body) or chord(header, body)")
        return self.body


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
    if kind == "chord":
        header, body = chord_members(value)
        return chord([maybe_signature(m) for m in header], maybe_signature(body), **options)
    return Signature(value)


def chord_members(sig: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], Mapping[str, Any]]:
    """A chord signature's header members and body, as maps (``sig`` must pass ``unhonoured``)."""
    inner = sig.get("kwargs") or {}
    header = inner.get("header")
    if isinstance(header, Mapping):
        header = (header.get("kwargs") or {}).get("tasks")
    return list(header or ()), inner["body"]


def _upgrade_to_chords(steps: list[Signature]) -> list[Signature]:
    # Celery's rule: a group followed by another step is a chord with that step as its body.
    out: list[Signature] = []
    index = 0
    while index < len(steps):
        step = steps[index]
        if isinstance(step, group) and index + 1 < len(steps):
            out.append(chord(step, steps[index + 1], app=step._app))
            index += 2
        else:
            out.append(step)
            index += 1
    return out


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

    A malformed signature or a canvas shape Clockwork does not run yet is refused as a whole, so
    no part of it is silently dropped. A chord header's message must also carry its group id and
    index (``chord_header_problem``).
    """
    body = embed.get("chord")
    if body is not None:
        why = _unhonoured_signature(body)
        if why is not None:
            return f"embed 'chord' (the chord's body): {why}"
        size = body.get("chord_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return (
                "embed 'chord' carries no chord_size: the chord was sent by a client whose result "
                "backend counts chords itself; send it with Clockwork's client or with "
                "Celery's backend='broker_svc.celery_backend:ChordBackend'"
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
    exchange = options.get("exchange")
    if exchange not in (None, "", options.get("queue"), options.get("routing_key")):
        # The worker sends follow-ups to a queue by name; a routing through another exchange would
        # be dropped in silence if it were simply ignored.
        return f"a follow-up sent through exchange {exchange!r} is not supported; give it a queue"
    for key in ("link", "link_error"):
        for inner in _as_list(options.get(key)):
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
        if isinstance(member, Mapping) and member.get("subtask_type") is not None:
            return _NESTED_HEADER
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


def _chord_follow_ups(
    sig: Mapping[str, Any],
    *,
    parent: TaskMessage,
    partial: Sequence[Any],
    chain_rest: Sequence[Mapping[str, Any]] | None,
) -> list[FollowUp]:
    # A chord as a step (Celery's chain of a group and a step): its header tasks, each carrying
    # the body with the chord's size; the steps after it run after its body.
    members, body = chord_members(sig)
    options = sig.get("options") or {}
    header = (sig.get("kwargs") or {}).get("header")
    header_options = (header.get("options") or {}) if isinstance(header, Mapping) else {}
    group_id = options.get("group_id") or header_options.get("task_id") or uuid4_str()
    body_options = {**(body.get("options") or {})}
    body_options.setdefault("task_id", options.get("task_id") or uuid4_str())
    body_options.setdefault("reply_to", options.get("reply_to") or parent.reply_to)
    if chain_rest:
        body_options["chain"] = list(chain_rest)
    if not members:
        return follow_ups({**body, "options": body_options}, parent=parent, partial=([],))
    carried = {**body, "options": body_options, "chord_size": len(members)}
    out: list[FollowUp] = []
    for index, member in enumerate(members):
        fixed = {**member, "options": {**(member.get("options") or {}), "group_id": group_id,
                                        "group_index": index, "chord": carried}}  # fmt: skip
        out.extend(follow_ups(fixed, parent=parent, partial=partial))
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
    message = TaskMessage(
        id=task_id,
        task=str(sig["task"]),
        args=args,
        kwargs=dict(sig.get("kwargs") or {}),
        embed={
            "callbacks": _as_list(options.get("link")) or None,
            "errbacks": _as_list(options.get("link_error")) or None,
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
