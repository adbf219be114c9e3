"""A signature: one task call not sent yet, as a map with Celery's keys (``add.s(2, 2)``).

Also the signatures of Celery's built-in tasks that take one task: ``task.map(it)``,
``task.starmap(it)`` and ``task.chunks(it, n)``. Chains, groups and chords of signatures are in
``broker_svc.canvas.primitives``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.wire.ids import uuid4_str

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.canvas.primitives import group
    from broker_svc.results.result import AsyncResult, GroupResult

__all__ = ["Signature", "chunks", "xmap", "xstarmap"]


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
        from broker_svc.tasks.shared import current_app  # at call time: shared imports task, which imports us

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
        from broker_svc.canvas.primitives import chain  # the canvas builds on signatures

        return chain(self, other, app=self._app)

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
        from broker_svc.canvas.primitives import group  # the canvas builds on signatures

        items, n = self.kwargs["it"], int(self.kwargs["n"])
        parts = [items[i : i + n] for i in range(0, len(items), n)]
        return group((xstarmap(self._task, part) for part in parts), app=self._app)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        return self.group().apply_async(**{**self.options, **options})


def wire_value(value: Any) -> Any:
    if isinstance(value, Signature):
        return value.as_wire()
    if isinstance(value, list | tuple):
        return [wire_value(v) for v in value]
    return value
