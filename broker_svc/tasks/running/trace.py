"""One run of a task body with everything Celery does around it: signals, hooks, outcome.

The worker's pool child and eager ``Task.apply()`` both run tasks through ``trace``, so a task
sees the same signals and hooks, and ends in the same outcomes, wherever it runs.
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

from broker_svc import signals
from broker_svc.errors import Ignore, Reject, Retry
from broker_svc.logging import get_logger
from broker_svc.tasks.request import ExceptionInfo, Request

__all__ = [
    "FAILURE",
    "IGNORED",
    "REJECTED",
    "RETRY",
    "SUCCESS",
    "Traced",
    "TracedTask",
    "empty_hook",
    "trace",
]

log = get_logger(__name__)

_Hook = TypeVar("_Hook", bound=Callable[..., None])

# How a run ended, by Celery's state names (and ours for Ignore and Reject).
SUCCESS: Final = "SUCCESS"
FAILURE: Final = "FAILURE"
RETRY: Final = "RETRY"
IGNORED: Final = "IGNORED"
REJECTED: Final = "REJECTED"


class TracedTask(Protocol):
    """What a run calls on a task (a ``Task``): its body, as the worker runs it, and its hooks."""

    def execute(self, args: Sequence[Any], kwargs: Mapping[str, Any], /) -> Any: ...

    def on_success(
        self, retval: Any, task_id: str, args: Sequence[Any], kwargs: Mapping[str, Any], /
    ) -> None: ...

    def on_failure(
        self,
        exc: BaseException,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo,
        /,
    ) -> None: ...

    def on_retry(
        self,
        exc: BaseException,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo,
        /,
    ) -> None: ...

    def after_return(
        self,
        status: str,
        retval: Any,
        task_id: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        einfo: ExceptionInfo | None,
        /,
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Traced:
    """How one run ended.

    Attributes:
        state: ``SUCCESS``, ``FAILURE``, ``RETRY``, ``IGNORED`` or ``REJECTED``.
        value: the return value (``SUCCESS``).
        exception: the error (``FAILURE``), the retry's cause (``RETRY``) or the ``Reject``.
        retry: the ``Retry`` raised (``RETRY``).
        traceback: the formatted traceback of ``exception``.
        retries_exhausted: the task failed because ``retry()`` had no retries left.
    """

    state: str
    value: Any = None
    exception: BaseException | None = None
    retry: Retry | None = None
    traceback: str | None = None
    retries_exhausted: bool = False


def trace(
    task: TracedTask,
    request: Request,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    started: Callable[[], None] | None = None,
    guard: AbstractContextManager[Any] | None = None,
    await_body: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
) -> Traced:
    """Run ``task`` once with its signals and hooks; how it ended (never raises for the task).

    Args:
        task: the task; its ``request`` must be ``request`` (``broker_svc.tasks.task.executing``).
        request: the run's request.
        args: positional arguments.
        kwargs: keyword arguments.
        started: called after ``task_prerun`` (the worker reports STARTED there).
        guard: entered around the body alone (the worker's soft time limit).
        await_body: runs an ``async def`` body's coroutine to its end and returns its value (the
            worker: on its thread's long-lived loop); by default, on a loop of its own (``apply()``).
    """
    task_id = request.id
    # A signal nobody connected costs a task nothing: its arguments are not even gathered.
    if signals.task_prerun.has_receivers:
        signals.task_prerun.send(sender=task, task_id=task_id, task=task, args=args, kwargs=kwargs)
    if started is not None:
        started()
    traced = _run(task, request, args, kwargs, guard or nullcontext(), await_body or _await_alone)
    if signals.task_postrun.has_receivers:
        signals.task_postrun.send(
            sender=task, task_id=task_id, task=task, args=args, kwargs=kwargs, state=traced.state,
            retval=traced.value if traced.state == SUCCESS else (traced.retry or traced.exception),
        )  # fmt: skip
    return traced


def _run(
    task: TracedTask,
    request: Request,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    guard: AbstractContextManager[Any],
    await_body: Callable[[Coroutine[Any, Any, Any]], Any],
) -> Traced:
    task_id = request.id
    try:
        with guard:
            value = task.execute(args, kwargs)
            if inspect.iscoroutine(value):  # an ``async def`` body (``Task.execute`` refuses the rest)
                value = await_body(value)
    except Ignore:
        return Traced(IGNORED)
    except Reject as reject:
        return Traced(REJECTED, exception=reject, traceback=traceback.format_exc())
    except Retry as retry:
        cause = retry.exc or retry
        einfo = ExceptionInfo(cause, traceback.format_exc())
        _hook(task.on_retry, cause, task_id, args, kwargs, einfo)
        _hook(task.after_return, RETRY, cause, task_id, args, kwargs, einfo)
        signals.task_retry.send(sender=task, request=request, reason=cause, einfo=einfo)
        return Traced(RETRY, exception=cause, retry=retry, traceback=einfo.traceback)
    except Exception as exc:
        einfo = ExceptionInfo(exc, traceback.format_exc())
        _hook(task.on_failure, exc, task_id, args, kwargs, einfo)
        _hook(task.after_return, FAILURE, exc, task_id, args, kwargs, einfo)
        signals.task_failure.send(
            sender=task, task_id=task_id, exception=exc, args=args, kwargs=kwargs,
            traceback=exc.__traceback__, einfo=einfo,
        )  # fmt: skip
        return Traced(
            FAILURE, exception=exc, traceback=einfo.traceback, retries_exhausted=request.retries_exhausted
        )
    on_success, after_return = _success_hooks(task)
    if on_success is not None:
        _hook(on_success, value, task_id, args, kwargs)
    if after_return is not None:
        _hook(after_return, SUCCESS, value, task_id, args, kwargs, None)
    if signals.task_success.has_receivers:
        signals.task_success.send(sender=task, result=value)
    return _SUCCEEDED if value is None else Traced(SUCCESS, value=value)


# The common run: a success that returned None (Traced is frozen, so one serves every such run).
_SUCCEEDED: Final = Traced(SUCCESS)


def empty_hook(hook: _Hook) -> _Hook:
    """Mark a base class's hook that does nothing: a run does not call it (``Task``'s own)."""
    hook.__clockwork_empty_hook__ = True  # type: ignore[attr-defined]
    return hook


def _success_hooks(task: TracedTask) -> tuple[Callable[..., None] | None, Callable[..., None] | None]:
    # ``on_success`` and ``after_return``, each None where it is an empty hook (nothing to call).
    on_success, after_return = task.on_success, task.after_return
    return (
        None if getattr(on_success, "__clockwork_empty_hook__", False) else on_success,
        None if getattr(after_return, "__clockwork_empty_hook__", False) else after_return,
    )


def _await_alone(coroutine: Coroutine[Any, Any, Any]) -> Any:
    # ``apply()`` of an ``async def`` task: a loop for this run alone, as ``asyncio.run`` makes one;
    # called inside a running loop (an async test, an eager app in a web handler), on a thread of
    # its own, as that loop's thread cannot run a second one. Either way the caller waits.
    import asyncio  # only a run of an async task needs it
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    context = contextvars.copy_context()  # the request the body sees
    with ThreadPoolExecutor(1, thread_name_prefix="clockwork-apply") as executor:
        return executor.submit(context.run, asyncio.run, coroutine).result()


def _hook(hook: Callable[..., None], *args: Any) -> None:
    # A hook that raises is logged; it never changes the task's outcome.
    try:
        hook(*args)
    except Exception:
        log.exception("task_hook_failed", hook=getattr(hook, "__name__", repr(hook)))
