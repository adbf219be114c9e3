"""Tasks: what ``@app.task`` makes, with ``delay``/``apply_async`` and signatures."""

from __future__ import annotations

import datetime as dt
import inspect
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from broker_svc import canvas
from broker_svc.errors import MaxRetriesExceededError, Retry
from broker_svc.library_log import get_logger
from broker_svc.pydantic_args import call_with_models
from broker_svc.request import SEND_OPTIONS, ExceptionInfo, Request, current_request, executing
from broker_svc.signature import Signature
from broker_svc.wire.rates import parse_rate

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.eager import EagerResult
    from broker_svc.result import AsyncResult as ResultHandle

__all__ = ["SEND_OPTIONS", "ExceptionInfo", "Request", "Signature", "Task", "current_request", "executing"]

# Signature (broker_svc.signature) and the request (broker_svc.request) are imported from here
# too, as before.

log = get_logger(__name__)


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
    # Per worker, as Celery's: "10/s", "100/m", "2/h", or a number per second; None means no limit.
    rate_limit: ClassVar[str | int | float | None] = None
    track_started: ClassVar[bool] = False
    max_retries: ClassVar[int | None] = 3
    default_retry_delay: ClassVar[float] = 180.0
    autoretry_for: ClassVar[tuple[type[BaseException], ...]] = ()
    retry_backoff: ClassVar[bool | float] = False
    retry_backoff_max: ClassVar[float] = 600.0
    retry_jitter: ClassVar[bool] = True
    # Passed to ``retry`` by ``autoretry_for`` (``max_retries``, ``countdown``), as Celery's.
    retry_kwargs: ClassVar[Mapping[str, Any]] = {}
    # Errors that ``autoretry_for`` would match but must not retry.
    dont_autoretry_for: ClassVar[tuple[type[BaseException], ...]] = ()
    # Expected errors: a failure with one of these is logged at info, without a traceback.
    throws: ClassVar[tuple[type[BaseException], ...]] = ()
    # Defaults for every send of this task (``apply_async`` options win).
    expires: ClassVar[float | dt.datetime | None] = None
    priority: ClassVar[int | None] = None
    # Check the arguments against the function's signature when the task is sent (Celery's default).
    typing: ClassVar[bool] = True
    # With ``ignore_result``, still send the result of a failure.
    store_errors_even_if_ignored: ClassVar[bool] = False
    # Accepted for Celery code; Clockwork always acks after the run and redelivers a task whose
    # child died (up to ``delivery_limit``): docs/migrating-from-celery.md.
    acks_late: ClassVar[bool | None] = None
    reject_on_worker_lost: ClassVar[bool | None] = None
    # Validate pydantic-model parameters from dicts and dump a model result (Celery 5.5's option).
    pydantic: ClassVar[bool] = False
    pydantic_strict: ClassVar[bool] = False
    pydantic_context: ClassVar[Mapping[str, Any] | None] = None
    pydantic_dump_kwargs: ClassVar[Mapping[str, Any] | None] = None

    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {
            "name", "bind", "ignore_result", "queue", "serializer", "time_limit", "soft_time_limit",
            "track_started", "max_retries", "default_retry_delay", "autoretry_for", "retry_backoff",
            "retry_backoff_max", "retry_jitter", "rate_limit", "retry_kwargs", "dont_autoretry_for",
            "throws", "expires", "priority", "typing", "store_errors_even_if_ignored", "acks_late",
            "reject_on_worker_lost", "pydantic", "pydantic_strict", "pydantic_context",
            "pydantic_dump_kwargs",
        }
    )  # fmt: skip

    @property
    def request(self) -> Request:
        """The current call's request; a ``called_directly`` one outside a worker."""
        return current_request() or Request()

    def retry(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: dt.datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Ask the worker to run this task again later (same id, ``retries + 1``), as Celery's.

        Use as ``raise self.retry(exc=exc)``; it always raises. ``args``/``kwargs`` replace the
        next attempt's arguments. Other send options (``queue``, ``priority``, ...) are not
        honoured on a retry: the copy goes back where it came from, and a warning says so.

        Raises:
            Retry: always, when retries are left; the worker republishes the task.
            BaseException: ``exc`` itself when no retries are left (the task fails with it).
            MaxRetriesExceededError: no retries are left and no ``exc`` was given.
        """
        request = self.request
        limit = self.max_retries if max_retries is None else max_retries
        if limit is not None and request.retries >= limit:
            request.retries_exhausted = True
            if exc is not None:
                raise exc
            raise MaxRetriesExceededError(
                f"can't retry {self.name}[{request.id}]: {request.retries} retries of {limit} used"
            )
        if eta is None:
            delay = self.default_retry_delay if countdown is None else countdown
            eta = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay)
        elif eta.tzinfo is None:
            eta = eta.replace(tzinfo=dt.UTC)
        if options:
            log.warning("retry_options_ignored", task_name=self.name, options=sorted(options))
        del throw  # a Retry is always raised here; the worker decides what the caller sees
        reason = f"retry in {(eta - dt.datetime.now(dt.UTC)).total_seconds():.1f} s"
        raise Retry(
            f"{reason}: {exc!r}" if exc is not None else reason,
            exc=exc,
            eta=eta,
            call_args=tuple(args) if args is not None else None,
            call_kwargs=dict(kwargs) if kwargs is not None else None,
        )

    def update_state(
        self, task_id: str | None = None, state: str | None = None, meta: Mapping[str, Any] | None = None
    ) -> None:
        """Report a state (``"PROGRESS"``, or any string) with ``meta`` to the task's client.

        Raises:
            RuntimeError: not running in a worker.
        """
        request = self.request
        if request.send_update is None:
            raise RuntimeError("update_state() works only while the task runs in a Clockwork worker")
        if task_id is not None and task_id != request.id:
            raise ValueError("update_state() can only update the running task")
        request.send_update({"state": state or "PROGRESS", "meta": dict(meta or {})})

    def backoff_delay(self, retries: int) -> float:
        """Seconds before retry number ``retries + 1`` under ``retry_backoff`` (Celery's formula)."""
        factor = 1.0 if self.retry_backoff is True else float(self.retry_backoff)
        delay: float = min(self.retry_backoff_max, factor * (2**retries))
        if self.retry_jitter:
            delay = random.uniform(0, delay)  # full jitter: spreads a thundering herd
        return delay

    def execute(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run the body as the worker does: ``autoretry_for`` errors become retries."""
        try:
            if self.pydantic:
                return call_with_models(
                    self.run, args, kwargs, strict=self.pydantic_strict, context=self.pydantic_context,
                    dump_kwargs=self.pydantic_dump_kwargs,
                )  # fmt: skip
            return self.run(*args, **kwargs)
        except Retry:
            raise
        except self.autoretry_for as exc:
            if self.dont_autoretry_for and isinstance(exc, self.dont_autoretry_for):
                raise
            options = dict(self.retry_kwargs)
            if self.retry_backoff:
                options["countdown"] = self.backoff_delay(self.request.retries)
            raise self.retry(exc=exc, **options) from exc

    # Hooks: override in a base class. Exceptions they raise are logged, never change the outcome.

    def on_success(self, retval: Any, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Called after the task succeeded."""

    def on_failure(
        self,
        exc: BaseException,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo,
    ) -> None:
        """Called after the task failed (for good)."""

    def on_retry(
        self,
        exc: BaseException,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo,
    ) -> None:
        """Called when the task is about to be retried."""

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo | None,
    ) -> None:
        """Called after every run, whatever its outcome."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The task body; replaced by the decorated function."""
        raise NotImplementedError(f"task {self.name} has no body")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task body here, in this process (as calling a Celery task does)."""
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<@task: {self.name}>"

    def delay(self, *args: Any, **kwargs: Any) -> ResultHandle:
        """Send the task with these arguments; see ``apply_async``."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ResultHandle:
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
        if self.typing:
            self.check_arguments(args or (), kwargs or {})
        if self.app.conf.get("task_always_eager"):
            return self.apply(args, kwargs, **options)  # type: ignore[return-value]  # Celery's eager mode
        merged = self._default_options()
        merged.update(options)
        return self.app.send_task(self.name, args, kwargs, **merged)

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> EagerResult:
        """Run the task here, now, as a worker would (Celery's eager ``apply``); its result.

        ``retry()`` runs it again at once. With ``throw=True`` (or the app's
        ``task_eager_propagates``) a failure raises at once.
        """
        from broker_svc.eager import apply  # eager imports trace, which imports this module

        return apply(self, args, kwargs, **options)

    def check_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise ``TypeError`` now if the task's function would not take these arguments.

        Raises:
            TypeError: the arguments do not fit the function's signature (as Celery's ``typing``).
        """
        signature = _call_signature(type(self))
        if signature is None:
            return
        try:
            if self.bind:
                signature.bind(self, *args, **kwargs)
            else:
                signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from None

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task with these arguments (a partial: more may be given later)."""
        return Signature(self.name, args, dict(kwargs), self._default_options(), app=self.app)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable signature: it ignores a parent's result and partial arguments."""
        return Signature(self.name, args, dict(kwargs), self._default_options(), immutable=True, app=self.app)

    def signature(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        immutable: bool = False,
        **options: Any,
    ) -> Signature:
        """A signature with arguments and send options (``subtask`` is the same)."""
        merged = self._default_options()
        merged.update(options)
        args = tuple(args or ())
        return Signature(self.name, args, dict(kwargs or {}), merged, immutable=immutable, app=self.app)

    subtask = signature

    def map(self, it: Iterable[Any]) -> canvas.xmap:
        """One task calling this one with each item (Celery's ``celery.map``)."""
        return canvas.xmap(self.s(), it)

    def starmap(self, it: Iterable[Sequence[Any]]) -> canvas.xstarmap:
        """One task calling this one with each item's arguments (Celery's ``celery.starmap``)."""
        return canvas.xstarmap(self.s(), it)

    def chunks(self, it: Iterable[Sequence[Any]], n: int) -> canvas.chunks:
        """The items in parts of ``n``, one ``starmap`` task per part, sent as a group."""
        return canvas.chunks(self.s(), it, n)

    def AsyncResult(self, task_id: str) -> ResultHandle:  # Celery's name
        """A result handle for a task this client sent (see ``App.AsyncResult``)."""
        return self.app.AsyncResult(task_id)

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
        if self.expires is not None:
            options["expires"] = self.expires
        if self.priority is not None:
            options["priority"] = self.priority
        return options


def _call_signature(cls: type[Task]) -> inspect.Signature | None:
    # Worked out once per task class: ``typing`` checks every send against it.
    if cls in _SIGNATURES:
        return _SIGNATURES[cls]
    function = getattr(cls, "__wrapped__", None)
    signature: inspect.Signature | None = None
    if function is not None:
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            pass  # a builtin or C function: nothing to check against
    _SIGNATURES[cls] = signature
    return signature


_SIGNATURES: dict[type[Task], inspect.Signature | None] = {}


def build_task_class(
    app: App, fn: Callable[..., Any], *, name: str, base: type[Task], options: Mapping[str, Any]
) -> type[Task]:
    """Make the task subclass for ``fn`` (Celery's pattern: one class per task).

    Raises:
        TypeError: an unknown task option, or a base that is not a ``Task``.
        ValueError: a ``rate_limit`` that is not a rate (``"10/s"``, ``"100/m"``, ``"2/h"``, a number).
    """
    if not (isinstance(base, type) and issubclass(base, Task)):
        raise TypeError(f"base must be a subclass of broker_svc.Task, got {base!r}")
    unknown = set(options) - base.OPTIONS
    if unknown:
        raise TypeError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(base.OPTIONS)}")
    try:
        parse_rate(options.get("rate_limit", base.rate_limit))
    except ValueError as exc:
        raise ValueError(f"task {name!r}: {exc}") from None
    bind = bool(options.get("bind", base.bind))
    attrs: dict[str, Any] = {
        **options,
        "name": name,
        "app": app,
        "run": fn if bind else staticmethod(fn),
        "__wrapped__": staticmethod(fn),
        "__doc__": fn.__doc__,
        "__module__": fn.__module__,
        "__qualname__": getattr(fn, "__qualname__", fn.__name__),
    }
    return type(fn.__name__, (base,), attrs)
