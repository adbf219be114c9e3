"""Tasks: what ``@app.task`` makes, with ``delay``/``apply_async`` and signatures."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.result import AsyncResult

__all__ = ["SEND_OPTIONS", "Signature", "Task"]

# Options ``apply_async``/``send_task`` accept; anything else is a TypeError with this list, so a
# typo (``countdwon=``) is caught at the call instead of silently ignored.
SEND_OPTIONS: Final = frozenset(
    {
        "task_id", "queue", "priority", "countdown", "eta", "expires", "time_limit",
        "soft_time_limit", "ignore_result", "serializer", "headers", "shadow",
        "parent_id", "root_id", "retries", "reply_to",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Signature:
    """A task call not sent yet: name, arguments and send options (``task.s(...)``)."""

    task: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


class Task:
    """Base class of tasks. ``@app.task`` makes a subclass whose ``run`` is the function.

    Class attributes are the task's options; subclass and pass ``base=`` to share them.
    """

    name: ClassVar[str] = ""
    app: ClassVar[App]
    bind: ClassVar[bool] = False
    ignore_result: ClassVar[bool] = False
    queue: ClassVar[str | None] = None
    serializer: ClassVar[str | None] = None
    time_limit: ClassVar[float | None] = None
    soft_time_limit: ClassVar[float | None] = None

    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {"name", "bind", "ignore_result", "queue", "serializer", "time_limit", "soft_time_limit"}
    )

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The task body; replaced by the decorated function."""
        raise NotImplementedError(f"task {self.name} has no body")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task body here, in this process (as calling a Celery task does)."""
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<@task: {self.name}>"

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult:
        """Send the task with these arguments; see ``apply_async``."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Send the task to a queue.

        Args:
            args: positional arguments.
            kwargs: keyword arguments.
            **options: ``task_id``, ``queue``, ``priority``, ``countdown`` (s), ``eta`` (datetime),
                ``expires`` (s or datetime), ``time_limit``, ``soft_time_limit``, ``ignore_result``,
                ``serializer``, ``headers``, ``shadow``.

        Raises:
            TypeError: an unknown option.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: (``confirm="each"``) the broker did not confirm it.
        """
        merged = self._default_options()
        merged.update(options)
        return self.app.send_task(self.name, args, kwargs, **merged)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task with these arguments, for ``app.send_many``."""
        return Signature(self.name, args, dict(kwargs), self._default_options())

    def signature(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> Signature:
        """A signature with arguments and send options."""
        merged = self._default_options()
        merged.update(options)
        return Signature(self.name, tuple(args), dict(kwargs or {}), merged)

    def _default_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.queue is not None:
            options["queue"] = self.queue
        if self.ignore_result:
            options["ignore_result"] = True
        if self.serializer is not None:
            options["serializer"] = self.serializer
        if self.time_limit is not None:
            options["time_limit"] = self.time_limit
        if self.soft_time_limit is not None:
            options["soft_time_limit"] = self.soft_time_limit
        return options


def build_task_class(
    app: App, fn: Callable[..., Any], *, name: str, base: type[Task], options: Mapping[str, Any]
) -> type[Task]:
    """Make the task subclass for ``fn`` (Celery's pattern: one class per task).

    Raises:
        TypeError: an unknown task option, or a base that is not a ``Task``.
    """
    if not (isinstance(base, type) and issubclass(base, Task)):
        raise TypeError(f"base must be a subclass of broker_svc.Task, got {base!r}")
    unknown = set(options) - base.OPTIONS
    if unknown:
        raise TypeError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(base.OPTIONS)}")
    bind = bool(options.get("bind", base.bind))
    attrs: dict[str, Any] = {
        **options,
        "name": name,
        "app": app,
        "run": fn if bind else staticmethod(fn),
        "__doc__": fn.__doc__,
        "__module__": fn.__module__,
        "__qualname__": getattr(fn, "__qualname__", fn.__name__),
    }
    return type(fn.__name__, (base,), attrs)


def countdown_to_eta(countdown: float) -> dt.datetime:
    """The ETA ``countdown`` seconds from now, in UTC (as Celery's client converts it)."""
    return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=countdown)
