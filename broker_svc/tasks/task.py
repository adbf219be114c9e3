"""Tasks: what ``@app.task`` makes, with ``delay``/``apply_async`` and signatures."""

from __future__ import annotations

import datetime as dt
import inspect
import random
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Generic

from typing_extensions import ParamSpec, TypeVar

from broker_svc.canvas import maps
from broker_svc.canvas.signature import Signature
from broker_svc.errors import MaxRetriesExceededError, Retry
from broker_svc.logging import get_logger
from broker_svc.tasks.arguments import check_call_arguments, retry_arguments
from broker_svc.tasks.pydantic_args import call_with_models
from broker_svc.tasks.request import SEND_OPTIONS, ExceptionInfo, Request, current_request, executing
from broker_svc.tasks.running.add_to_chord import add_to_chord
from broker_svc.tasks.running.eager import EagerResult, apply
from broker_svc.tasks.running.replace import replace
from broker_svc.tasks.running.trace import empty_hook

if TYPE_CHECKING:
    from broker_svc.results.result import AsyncResult as ResultHandle
    from broker_svc.sending.dedup_keys import TaskDedup
    from broker_svc.tasks.task_app import TaskApp

__all__ = ["SEND_OPTIONS", "ExceptionInfo", "Request", "Signature", "Task", "current_request", "executing"]

# A task's parameters and return type, taken from its function by ``@app.task`` (``Task[P, R]``).
# The defaults (any arguments, any result) keep a bare ``Task`` meaning what it always meant.
P = ParamSpec("P", default=...)
R = TypeVar("R", default=Any)

# Signature and the request are imported from here too.

log = get_logger(__name__)


class Task(Generic[P, R]):
    """Base class of tasks. ``@app.task`` makes a subclass whose ``run`` is the function.

    Class attributes are the task's options; subclass and pass ``base=`` to share them.

    For type checkers a decorated ``def add(x: int, y: int) -> int`` is a ``Task[[int, int], int]``:
    ``add(1, 2)``, ``add.delay(1, 2)`` and ``add.si(1, 2)`` are checked against the function's
    parameters, and ``add.delay(1, 2).get()`` is an ``int``. ``s`` (a partial) and
    ``apply_async(args, kwargs)`` take any arguments; ``typing`` checks those when they are sent.
    """

    name: ClassVar[str] = ""
    app: ClassVar[TaskApp]
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
    default_retry_delay: ClassVar[float] = 180  # an int, as Celery shows it (inspect registered)
    autoretry_for: ClassVar[tuple[type[BaseException], ...]] = ()
    retry_backoff: ClassVar[bool | float] = False
    retry_backoff_max: ClassVar[float] = 600
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
    # Keyed deduplication (``apply_async``): an argument's name or a callable of the arguments,
    # and the gate's safety timeout in seconds; ``_dedup`` is their checked form (dedup_keys.py).
    dedup_key: ClassVar[str | Callable[..., object] | None] = None
    dedup_timeout: ClassVar[float | None] = None
    _dedup: ClassVar[TaskDedup | None] = None

    OPTIONS: ClassVar[frozenset[str]] = frozenset(
        {
            "name", "bind", "ignore_result", "queue", "serializer", "time_limit", "soft_time_limit",
            "track_started", "max_retries", "default_retry_delay", "autoretry_for", "retry_backoff",
            "retry_backoff_max", "retry_jitter", "rate_limit", "retry_kwargs", "dont_autoretry_for",
            "throws", "expires", "priority", "typing", "store_errors_even_if_ignored", "acks_late",
            "reject_on_worker_lost", "pydantic", "pydantic_strict", "pydantic_context",
            "pydantic_dump_kwargs", "dedup_key", "dedup_timeout",
        }
    )  # fmt: skip

    @property
    def request(self) -> Request:
        """The current call's request; a ``called_directly`` one outside a worker."""
        return current_request() or Request()

    def replace(self, sig: Signature) -> Any:
        """Hand this task's place to ``sig`` (a signature, a chain or a group), as Celery's does:
        its caller gets the replacement's result, the rest of its chain runs after it, and its
        callbacks, errbacks and chord go with it (``broker_svc/tasks/running/replace.py``). Raises
        ``Ignore`` (so use it as ``return self.replace(sig)``); run eagerly, returns the value.

        Raises:
            ValueError: ``sig`` is part of a chord of its own, or an empty chain.
        """
        return replace(self.app, self.request, sig)

    def add_to_chord(self, sig: Signature, lazy: bool = False) -> Any:
        """Add ``sig`` to the chord this task is a header task of, as Celery's does: the body waits
        for it too and gets its value right after this task's (``broker_svc/tasks/running/add_to_chord.py``).
        Returns its result, or (``lazy``) ``sig``, already counted, to send yourself.

        Raises:
            ValueError: this task is not a chord's header task.
        """
        return add_to_chord(self.app, self.request, sig, lazy=lazy)

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
        next attempt's arguments, as Celery 5.7's: given one alone, the call's other half is kept
        where it does not clash (``retry_arguments``). Other send options (``queue``,
        ``priority``, ...) are not honoured on a retry: the copy goes back where it came from, and
        a warning says so.

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
        call_args: tuple[Any, ...] | None = None
        call_kwargs: dict[str, Any] | None = None
        if args is not None or kwargs is not None:  # both halves, so the worker keeps neither
            next_args, call_kwargs = retry_arguments(self.run, request.args, request.kwargs, args, kwargs)
            call_args = tuple(next_args)
        raise Retry(
            f"{reason}: {exc!r}" if exc is not None else reason,
            exc=exc,
            eta=eta,
            call_args=call_args,
            call_kwargs=call_kwargs,
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
        """Run the body as the worker does: ``autoretry_for`` errors become retries.

        An ``async def`` body gives a coroutine that does the same when awaited (the worker awaits
        it on its thread's loop). A plain body that returns an awaitable is a mistake (a missing
        ``async``, a decorator that hid it): ``TypeError``, not a value nobody will await.
        """
        try:
            if self.pydantic:
                value = call_with_models(
                    self.run, args, kwargs, strict=self.pydantic_strict, context=self.pydantic_context,
                    dump_kwargs=self.pydantic_dump_kwargs,
                )  # fmt: skip
            else:
                value = self.run(*args, **kwargs)
        except Retry:
            raise
        except self.autoretry_for as exc:
            self._autoretry(exc)
            raise
        if inspect.isawaitable(value):
            if inspect.iscoroutinefunction(self.run) and inspect.iscoroutine(value):
                return self._autoretrying(value)
            if inspect.iscoroutine(value):
                value.close()  # never run: no "never awaited" warning on top of the error
            raise TypeError(
                f"task {self.name} returned {type(value).__name__}, an awaitable, but its function is not"
                " `async def`: declare it `async def` (a decorator must keep it a coroutine function)"
            )
        return value

    async def _autoretrying(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        # An ``async def`` body's errors reach ``autoretry_for`` only as it is awaited.
        try:
            return await coroutine
        except Retry:
            raise
        except self.autoretry_for as exc:
            self._autoretry(exc)
            raise

    def _autoretry(self, exc: BaseException) -> None:
        # Raises the retry ``autoretry_for`` asks for; returns when ``dont_autoretry_for`` says no.
        if self.dont_autoretry_for and isinstance(exc, self.dont_autoretry_for):
            return
        options = dict(self.retry_kwargs)
        if self.retry_backoff:
            options["countdown"] = self.backoff_delay(self.request.retries)
        raise self.retry(exc=exc, **options) from exc

    # Hooks: override in a base class. Exceptions they raise are logged, never change the outcome.

    @empty_hook
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

    @empty_hook
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

    def run(self, *args: Any, **kwargs: Any) -> R:
        """The task body; replaced by the decorated function."""
        raise NotImplementedError(f"task {self.name} has no body")

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run the task body here, in this process (as calling a Celery task does)."""
        return self.run(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<@task: {self.name}>"

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> ResultHandle[R]:
        """Send the task with these arguments; see ``apply_async``."""
        return self.apply_async(args, kwargs)

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ResultHandle[R]:
        """Send the task to a queue.

        Args:
            args: positional arguments.
            kwargs: keyword arguments.
            **options: ``task_id``, ``queue``, ``priority``, ``countdown`` (s), ``eta`` (datetime),
                ``expires`` (s or datetime), ``time_limit``, ``soft_time_limit``, ``ignore_result``,
                ``serializer``, ``headers``, ``shadow``; ``dedup_key``: this call's key, used as
                it is (over the task's own): one call per key runs cluster-wide, one more waits,
                the rest are declined (``TaskDeclined``); ``dedup_timeout``: the gate's safety
                timeout, seconds (0 < t <= 1500; default the task's, else 600). Eager mode
                (``task_always_eager``) ignores both, as it ignores routing. See ``App.task``.

        Raises:
            TypeError: an unknown option; a dedup key on a chord's header task or where a
                worker sends the task later (a callback, a chain's later step); ``exchange=``
                with a dedup key.
            ValueError: a dedup key that is empty or over 200 UTF-8 bytes, a timeout out of range.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: (``confirm="each"``) the broker did not confirm it.
        """
        if self.typing:
            self.check_arguments(args or (), kwargs or {})
        if self.app.conf.get("task_always_eager"):
            return self.apply(args, kwargs, **options)  # type: ignore[return-value]  # Celery's eager mode
        merged = self.send_options()
        merged.update(options)
        return self.app.send_task(self.name, args, kwargs, **merged)

    def apply(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> EagerResult:
        """Run the task here, now, as a worker would (Celery's eager ``apply``); its result.

        ``retry()`` runs it again at once. With ``throw=True`` (or the app's
        ``task_eager_propagates``) a failure raises at once.
        """
        return apply(self, args, kwargs, **options)

    def check_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise ``TypeError`` now if the task's function would not take these arguments.

        Raises:
            TypeError: the arguments do not fit the function's signature (as Celery's ``typing``).
        """
        check_call_arguments(self, args, kwargs)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A signature of this task with these arguments (a partial: more may be given later)."""
        return Signature(self.name, args, dict(kwargs), self.send_options(), app=self.app)

    def si(self, *args: P.args, **kwargs: P.kwargs) -> Signature:
        """An immutable signature: it ignores a parent's result and partial arguments."""
        return Signature(self.name, args, dict(kwargs), self.send_options(), immutable=True, app=self.app)

    def signature(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        immutable: bool = False,
        **options: Any,
    ) -> Signature:
        """A signature with arguments and send options (``subtask`` is the same)."""
        merged = self.send_options()
        merged.update(options)
        args = tuple(args or ())
        return Signature(self.name, args, dict(kwargs or {}), merged, immutable=immutable, app=self.app)

    subtask = signature

    def map(self, it: Iterable[Any]) -> maps.xmap:
        """One task calling this one with each item (Celery's ``celery.map``)."""
        return maps.xmap(self.s(), it)

    def starmap(self, it: Iterable[Sequence[Any]]) -> maps.xstarmap:
        """One task calling this one with each item's arguments (Celery's ``celery.starmap``)."""
        return maps.xstarmap(self.s(), it)

    def chunks(self, it: Iterable[Sequence[Any]], n: int) -> maps.chunks:
        """The items in parts of ``n``, one ``starmap`` task per part, sent as a group."""
        return maps.chunks(self.s(), it, n)

    def AsyncResult(self, task_id: str) -> ResultHandle[R]:  # Celery's name
        """A result handle for a task this client sent (see ``App.AsyncResult``)."""
        return self.app.AsyncResult(task_id)

    def send_options(self) -> dict[str, Any]:
        """The send options this task's declaration gives every send of it (``queue``, ``priority``,
        limits, ...): ``delay()``, ``enqueue`` and the scheduler put a call's own options over them,
        as Celery's ``apply_async`` and beat do."""
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
