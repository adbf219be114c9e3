"""The soft time limit: ``SoftTimeLimitExceeded`` raised inside a task body that runs past it.

In a child's main thread (one thread per child) the limit is a SIGALRM, which ``SoftLimit`` turns
into the exception where the body runs. A signal reaches only a process's main thread, so under
``--threads N`` one timer thread per child (``ThreadSoftLimits``) keeps every thread's deadline
and, when one passes while that thread's task body runs, raises ``SoftTimeLimitExceeded`` in that
thread with ``PyThreadState_SetAsyncExc`` (as Dramatiq's time limits do).

The limit of that mechanism, documented for users: the exception lands when the thread next runs
Python bytecode, so a task blocked inside one C call (a ``socket.recv`` without a timeout, say)
sees it only when that call returns. The hard time limit does not depend on it.

No exception escapes past the body: disarming clears one still pending, under the lock the timer
raises under.

An ``async def`` body is not interrupted that way (the exception would land in the thread's event
loop, not in the task): while it runs, the limit calls the interrupt its ``TaskLoop`` registered,
which cancels the coroutine from the loop (``worker/child/task_loop.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from types import FrameType

import structlog

from broker_svc.errors import SoftTimeLimitExceeded

__all__ = ["SoftLimit", "ThreadSoftLimits"]

log = structlog.get_logger(__name__)


class SoftLimit:
    """Turns the soft time limit's signal (SIGALRM) into ``SoftTimeLimitExceeded`` inside the running task."""

    def __init__(self) -> None:
        self.armed = False
        self.limit_s: float | None = None
        self._interrupt: Callable[[BaseException], None] | None = None

    def arm(self, limit_s: float | None) -> None:
        self.limit_s, self.armed = limit_s, True

    def disarm(self) -> None:
        self.armed = False

    def guarding(self, limit_s: float | None) -> AbstractContextManager[None]:
        """Armed while the body runs, disarmed however it ends."""
        return _Armed(self, limit_s)

    @contextlib.contextmanager
    def redirected(self, interrupt: Callable[[BaseException], None]) -> Iterator[None]:
        """While an ``async def`` body runs on its loop: give the exception to ``interrupt`` (which
        cancels the coroutine from the loop) rather than raise it where the thread is, which may
        be the loop's own code (``worker/child/task_loop.py``)."""
        self._interrupt = interrupt
        try:
            yield
        finally:
            self._interrupt = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A signal that lands after the task ended is moot: the worker sent it at the deadline
        # while the done frame was on its way. Disarm first so a second signal cannot raise twice.
        if self.armed:
            self.armed = False
            exc = SoftTimeLimitExceeded(f"soft time limit ({self.limit_s:g} s) exceeded")
            if self._interrupt is not None:
                self._interrupt(exc)  # only schedules the cancel: safe from a signal handler
                return
            raise exc


class _Armed:
    # SoftLimit.guarding's: a class, not a generator, as it is entered once per task.
    __slots__ = ("_limit", "_limit_s")

    def __init__(self, limit: SoftLimit, limit_s: float | None) -> None:
        self._limit, self._limit_s = limit, limit_s

    def __enter__(self) -> None:
        self._limit.arm(self._limit_s)

    def __exit__(self, *exc: object) -> None:
        self._limit.disarm()


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int


class ThreadSoftLimits:
    """The deadlines of every thread of one child, kept by one timer thread (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []  # (deadline, token)
        self._armed: dict[int, int] = {}  # token -> the thread ident to raise in
        self._interrupts: dict[int, Callable[[], None]] = {}  # token -> instead of raising (async def)
        self._tokens = itertools.count(1)
        self._thread: threading.Thread | None = None

    def for_thread(self) -> SoftLimit:
        """A ``SoftLimit`` for ``run_job`` in the calling thread."""
        return _ThreadSoftLimit(self)

    def arm(self, limit_s: float) -> int:
        """Raise in the calling thread ``limit_s`` from now unless disarmed; the token to disarm."""
        token = next(self._tokens)
        with self._lock:
            self._armed[token] = threading.get_ident()
            heapq.heappush(self._heap, (time.monotonic() + limit_s, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="clockwork-soft-limits", daemon=True)
                self._thread.start()
            self._wake.notify()
        return token

    def disarm(self, token: int) -> None:
        """The body ended: no exception for it from now on, not even one already on its way."""
        with self._lock:
            self._interrupts.pop(token, None)
            if self._armed.pop(token, None) is None:  # it fired: clear it if not raised yet
                _set_async_exc(threading.get_ident(), ctypes.py_object())

    def redirect(self, token: int, interrupt: Callable[[], None] | None) -> None:
        """At ``token``'s deadline call ``interrupt`` instead of raising in the thread (None: raise)."""
        with self._lock:
            if interrupt is None:
                self._interrupts.pop(token, None)
            else:
                self._interrupts[token] = interrupt

    def _watch(self) -> None:
        with self._lock:
            while True:
                if not self._heap:
                    self._wake.wait()
                    continue
                deadline, token = self._heap[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                heapq.heappop(self._heap)
                ident = self._armed.pop(token, None)
                interrupt = self._interrupts.pop(token, None)
                if ident is None:
                    continue  # the body ended in time
                if interrupt is None:
                    _set_async_exc(ident, ctypes.py_object(SoftTimeLimitExceeded))
                    continue
                try:
                    interrupt()  # only schedules the cancel on the task's loop
                except Exception:  # never end this thread: the other threads' limits need it
                    log.exception("soft_time_limit_interrupt_failed")


class _ThreadSoftLimit(SoftLimit):
    """``SoftLimit``'s interface for a task in a thread: the limit arms this child's timer thread."""

    def __init__(self, limits: ThreadSoftLimits) -> None:
        super().__init__()
        self._limits = limits
        self._token: int | None = None  # while a body with a limit runs

    def guarding(self, limit_s: float | None) -> AbstractContextManager[None]:
        return self._guarding(limit_s) if limit_s else contextlib.nullcontext()

    @contextlib.contextmanager
    def _guarding(self, limit_s: float) -> Iterator[None]:
        token = self._limits.arm(limit_s)
        self._token, self.limit_s = token, limit_s
        try:
            yield
        except SoftTimeLimitExceeded as exc:
            if exc.args:
                raise
            # Raised by the timer, which can only name the type: give it the message.
            raise SoftTimeLimitExceeded(f"soft time limit ({limit_s:g} s) exceeded") from None
        finally:
            self._token = None
            self._limits.disarm(token)

    @contextlib.contextmanager
    def redirected(self, interrupt: Callable[[BaseException], None]) -> Iterator[None]:
        token, limit_s = self._token, self.limit_s
        if token is None or limit_s is None:  # no limit on this body
            yield
            return
        message = f"soft time limit ({limit_s:g} s) exceeded"
        self._limits.redirect(token, lambda: interrupt(SoftTimeLimitExceeded(message)))
        try:
            yield
        finally:
            self._limits.redirect(token, None)
