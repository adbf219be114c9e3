"""The canvas: signatures, and the chains, groups and chords built of them, sent as Celery's client
sends them. One module, as one concept: ``a | b`` on a signature makes a chain, a chain of a group
and a step makes a chord, and each of them is a signature.

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
  ``celery.map``, ``celery.starmap`` and (as a group of starmaps) ``celery.chunks``
  (``broker_svc/canvas/maps.py``).
- ``chord(header, body)`` (or ``group(...) | body``, or a group followed by more steps in a chain)
  sends the header's tasks, each carrying the body (with the chord's size) in its ``chord`` field;
  their workers leave each header task's end with the chord's joiner, which sends the body with
  the header's results once all are in (worker/single_active/chord_join.py). The call returns the
  body's result, whose ``parent`` is the header's ``GroupResult``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.canvas import stamping
from broker_svc.canvas.chord_header import as_joined, unrolled
from broker_svc.canvas.follow_ups import as_list, chord_members, chords_for_groups
from broker_svc.canvas.stamping import StampingVisitor
from broker_svc.results.result import GroupResult
from broker_svc.sending.routes import queue_for
from broker_svc.tasks.task_app import current_app
from broker_svc.wire.ids import uuid4_str
from broker_svc.wire.records.chord_part import NAMESPACE_KEY

if TYPE_CHECKING:
    from broker_svc.results.result import AsyncResult
    from broker_svc.tasks.task_app import TaskApp

__all__ = ["Signature", "chain", "chord", "group", "maybe_signature", "signature", "wire_value"]


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
        app: TaskApp | None = None,
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
    def app(self) -> TaskApp:
        """The app that sends this signature."""
        return self._app if self._app is not None else current_app()

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], app: TaskApp | None = None) -> Signature:
        """The signature a map stands for, of its kind (Celery's ``Signature.from_dict``): a task
        rebuilding a chain, group or chord from its dict gets one, nested as deep as it goes."""
        return maybe_signature(d, app)

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
        return chain(self, other, app=self._app)

    # -- stamping (Celery's; broker_svc/canvas/stamping.py) ------------------------------------------

    def stamp(
        self, visitor: StampingVisitor | None = None, append_stamps: bool = False, **headers: Any
    ) -> Signature:
        """Stamp it, and every task it holds, with ``headers`` and the stamps ``visitor`` returns.

        Each stamp is sent in the task's ``stamped_headers``/``stamps`` headers, kept on what the
        worker sends after it, and revocable with ``app.control.revoke_by_stamped_headers``.
        ``append_stamps``: a stamp given again keeps its old values too, in a list. Returns this
        signature (Celery's chain, group and chord return None).
        """
        stamping.stamp(self, visitor, append_stamps, headers)
        return self

    def stamp_links(
        self, visitor: StampingVisitor | None = None, append_stamps: bool = False, **headers: Any
    ) -> None:
        """Stamp its callbacks and errbacks (not it) with ``headers`` and the visitor's stamps."""
        found = []
        for key in ("link", "link_error"):
            # As signatures, kept in place: a callback given as a map keeps its stamps too.
            links = [maybe_signature(link, self._app) for link in as_list(self.options.get(key))]
            if links:
                self.options[key] = links
            found.append(links)
        stamping.stamp_links(self, found[0], found[1], visitor, append_stamps, headers)

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
        return self.app.send_task(self.task, new_args, new_kwargs, **self._merged(options))

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Any:
        """Run it here, now (``Task.apply``); an ``EagerResult``.

        Raises:
            NotRegistered: the app has no task of this name.
        """
        new_args, new_kwargs = self._partial(args, kwargs)
        return self.app.get_task(self.task).apply(new_args, new_kwargs, **self._merged(options))

    def _merged(self, options: Mapping[str, Any]) -> dict[str, Any]:
        # Celery's rule: a call's options override the signature's, except its group id and its
        # stamps (changing them would strand the task's chord or revoke), kept once set.
        kept = {"group_id", "stamped_headers", *(self.options.get("stamped_headers") or ())}
        return {
            **self.options,
            **{k: v for k, v in options.items() if k not in kept or k not in self.options},
        }

    def as_wire(self) -> dict[str, Any]:
        """A plain map for a task message: nested signatures as maps, args as a list."""
        options = {k: wire_value(v) for k, v in self.options.items()}
        return {
            "task": self.task,
            "args": [wire_value(a) for a in self.args],
            "kwargs": {k: wire_value(v) for k, v in self.kwargs.items()},
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


def wire_value(value: Any) -> Any:
    if isinstance(value, Signature):
        return value.as_wire()
    if isinstance(value, list | tuple):
        return [wire_value(v) for v in value]
    return value


class chain(Signature):
    """Steps run one after another, each given the one before's result (``a | b | c``)."""

    def __init__(
        self, *tasks: Signature | Iterable[Signature], app: TaskApp | None = None, **options: Any
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

    def freeze(self, _id: str | None = None, **fields: Any) -> AsyncResult | GroupResult:  # type: ignore[override]
        """Give every step its id (the last one ``_id``); the last step's result, ``parent`` linked."""
        steps = self.tasks
        results = [
            step.freeze(_id if i == len(steps) - 1 else None, **fields) for i, step in enumerate(steps)
        ]
        for before, after in itertools.pairwise(results):
            if not isinstance(after, GroupResult):
                after.parent = before
        return results[-1]

    def __call__(self, *args: Any, **kwargs: Any) -> AsyncResult | GroupResult:
        """Send it (Celery's ``chain(...)()``, in a task body too): ``apply_async(args, kwargs)``."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> AsyncResult | GroupResult:
        """Send the first step, carrying the rest; the last step's result (``.parent``: the one before).

        A group as the last step runs once the step before it has, each member with that step's
        result; the call returns its ``GroupResult``, as Celery's does.

        Raises:
            ValueError: an empty chain.
        """
        steps = _upgrade_to_chords([step.clone() for step in self.tasks])
        if not steps:
            raise ValueError("an empty chain has nothing to send")
        if len(steps) == 1:
            return steps[0].apply_async(args, kwargs, **{**self.options, **options})
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
        results: list[AsyncResult | GroupResult] = []
        # Results are registered before anything is sent: a fast step's result finds its waiter.
        for index, step in enumerate(steps[1:], start=1):
            results.append(step.freeze(last_id if index == len(steps) - 1 else None, root_id=root_id))
        rest = [step.as_wire() for step in reversed(steps[1:])]
        previous: Any = first.apply_async(chain=rest, **options)
        for result in results:
            if not isinstance(result, GroupResult):  # a closing group's members follow its members
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
        self, *tasks: Signature | Iterable[Signature], app: TaskApp | None = None, **options: Any
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

    def freeze(self, _id: str | None = None, **fields: Any) -> GroupResult:  # type: ignore[override]
        """Give the group its id (``_id``) and each member its own; the ``GroupResult`` it will have
        (Celery's: a group's ``freeze`` returns its group result)."""
        group_id = self.options.setdefault("task_id", _id or uuid4_str())
        fields = {k: v for k, v in fields.items() if k not in ("group_id", "group_index")}
        members = [member.freeze(**fields) for member in self.tasks]
        return GroupResult(group_id, members, app=self._app or (self.tasks[0].app if self.tasks else None))

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

        group_id = options.pop("group_id", None) or uuid4_str()
        return GroupResult(group_id, [member.apply(args, kwargs, **options) for member in self.tasks])

    def clone(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> group:
        members = (member.clone(args, kwargs) for member in self.tasks)
        return group(members, app=self._app, **{**self.options, **options})

    def __call__(self, *partial_args: Any, **options: Any) -> GroupResult:
        """Send it (Celery's ``group(...)()``, in a task body too): partial arguments for every member."""
        return self.apply_async(partial_args, **options)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        """Send every member with the group's id and its index; their results as one.

        Raises:
            PublishError: (``confirm="each"``) the broker did not confirm one of them.
        """

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
    send it. The header's results are counted in the broker (worker/single_active/chord_join.py): no
    result store, no polling. If a header task fails, the body does not run and its result is a
    ``ChordError`` naming the failed task.
    """

    def __init__(
        self,
        header: Signature | Iterable[Signature],
        body: Signature | None = None,
        *,
        app: TaskApp | None = None,
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
            ValueError: no body, or an empty chain in the header.
            PublishError: (``confirm="each"``) the broker did not confirm a header task.
        """

        body = (body or self._body_or_raise()).clone()
        members = self.tasks
        options = {**self.options, **options}
        group_id = options.pop("group_id", None) or uuid4_str()
        body_id = options.pop("task_id", None) or body.id
        rest = options.pop("chain", None)
        app = self._app or body.app
        body._app = body._app or app
        if rest:
            body.options["chain"] = rest  # the steps after the chord run after its body
        if body.subtask_type is None and "queue" not in body.options:
            # Routed here, as its header is: the joiner sends it where it says, never by its own app.
            declared = app.tasks.get(body.task)
            queue, routed = queue_for(
                app.conf.get("task_routes"), body.task, body.args, body.kwargs, body.options,
                declared=declared.queue if declared is not None else None, default=app.settings.default_queue,
            )  # fmt: skip
            if not routed.get("exchange"):  # a worker sends follow-ups to queues by name
                body.options["queue"] = queue
        result = body.freeze(body_id, group_id=group_id)
        if not members:
            body.apply_async(([],), **options)
            result.parent = GroupResult(group_id, [], app=app)
            return result
        # A header of chains, groups and chords: one part per member, groups unrolled (chord_header.py).
        cloned = (_upgraded_chains(member.clone(args, kwargs)) for member in members)
        parts = [maybe_signature(member, app) for member in unrolled(cloned)]
        # Its size, and whose joiner joins it: this app's, whichever app's worker runs a header task.
        carried = {**body.as_wire(), "chord_size": len(parts), NAMESPACE_KEY: app.settings.namespace}
        plain: list[tuple[int, Signature]] = []
        results: list[AsyncResult | GroupResult | None] = []
        for index, member in enumerate(parts):
            if member.subtask_type is None:
                membership = {"group_id": group_id, "group_index": index, "chord": carried}
                step = {**member.options, **options, **membership}
                plain.append((index, Signature(member.task, member.args, member.kwargs, step)))
                results.append(None)
            else:
                joined = maybe_signature(as_joined(member, group_id=group_id, index=index, body=carried), app)
                results.append(joined.apply_async(**options))
        for (index, _), sent in zip(plain, app.send_many(s for _, s in plain), strict=True):
            results[index] = sent
        result.parent = GroupResult(group_id, [r for r in results if r is not None], app=app)
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


def signature(task: str | Mapping[str, Any], *args: Any, **kwargs: Any) -> Signature:
    """A signature from a name (Celery's ``signature('tasks.add', args=(2, 2))``) or a map."""
    if isinstance(task, Mapping):
        return maybe_signature(task)
    return Signature(task, *args, **kwargs)


def maybe_signature(value: Signature | Mapping[str, Any], app: TaskApp | None = None) -> Signature:
    """``value`` as a signature of the right kind (a chain's, group's or chord's map becomes one,
    nested as deep as it goes), bound to ``app`` if given."""
    if isinstance(value, Signature):
        return value
    kind = value.get("subtask_type")
    inner = value.get("kwargs") or {}
    options = dict(value.get("options") or {})
    if kind == "chain":
        return chain(*(maybe_signature(s, app) for s in inner.get("tasks", ())), app=app, **options)
    if kind == "group":
        return group(*(maybe_signature(s, app) for s in inner.get("tasks", ())), app=app, **options)
    if kind == "chord":
        header, body = chord_members(value)
        return chord(
            [maybe_signature(m, app) for m in header], maybe_signature(body, app), app=app, **options
        )
    sig = Signature(value)
    sig._app = app or sig._app
    return sig


def _upgrade_to_chords(steps: list[Signature]) -> list[Signature]:
    # Celery's rule (follow_ups.chords_for_groups, which the worker applies to maps): a group
    # followed by another step is a chord with that step as its body.
    app = next((step._app for step in steps if step._app is not None), None)
    return [maybe_signature(step, app) for step in chords_for_groups(steps)]


def _upgraded_chains(sig: Signature) -> Signature:
    # A chain in a chord's header is sent by its own apply_async, which makes a group followed by a
    # step a chord; its last step (which leaves the part) must be seen as that chord here too.
    if isinstance(sig, chain):
        return chain(*_upgrade_to_chords(sig.tasks), app=sig._app, **sig.options)
    return sig


def _steps_of(sig: Signature) -> list[Signature]:
    return list(sig.tasks) if isinstance(sig, chain) else [sig]
