"""Signals with Celery's names and arguments: hooks around each task run and the worker's life.

``@task_prerun.connect`` (or ``task_prerun.connect(handler, sender=task)``) registers a receiver;
the worker calls each with ``signal=``, ``sender=`` and the signal's named arguments, as Celery
does. A receiver that raises is logged and never changes the task's outcome.

Where each is sent: ``worker_process_init`` in each pool child once the app is loaded; the
``task_*`` signals around the body in the child; ``task_received``, ``task_revoked``,
``worker_ready`` and ``worker_shutdown`` in the worker's main process; ``before_task_publish``
(whose receivers may add headers) and ``after_task_publish`` in the sending client.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, overload

from broker_svc.logging import get_logger

__all__ = [
    "Signal",
    "after_task_publish",
    "before_task_publish",
    "task_failure",
    "task_postrun",
    "task_prerun",
    "task_received",
    "task_retry",
    "task_revoked",
    "task_success",
    "worker_process_init",
    "worker_ready",
    "worker_shutdown",
]

log = get_logger(__name__)

Receiver = Callable[..., Any]


class Signal:
    """One hook point; receivers are kept by weak reference unless ``weak=False``.

    Args:
        name: the signal's name (Celery's).
        providing_args: the named arguments it is sent with (documentation only).
    """

    def __init__(self, name: str, providing_args: tuple[str, ...] = ()) -> None:
        self.name = name
        self.providing_args = providing_args
        self._lock = threading.Lock()
        # (key, reference to the receiver, sender filter or None)
        self._receivers: list[tuple[object, Callable[[], Receiver | None], Any]] = []

    def __repr__(self) -> str:
        return f"<Signal: {self.name}>"

    @overload
    def connect(self, receiver: Receiver, /, *, sender: Any = None, weak: bool = True,
                dispatch_uid: object = None) -> Receiver: ...  # fmt: skip

    @overload
    def connect(self, receiver: None = None, /, *, sender: Any = None, weak: bool = True,
                dispatch_uid: object = None) -> Callable[[Receiver], Receiver]: ...  # fmt: skip

    def connect(
        self, receiver: Receiver | None = None, /, *, sender: Any = None, weak: bool = True,
        dispatch_uid: object = None,
    ) -> Receiver | Callable[[Receiver], Receiver]:  # fmt: skip
        """Register ``receiver`` (also as a decorator, with or without arguments).

        Args:
            sender: only sends from this sender reach it: the same object, or a task of the same
                name (a task object, a ``shared_task`` or the name as a string).
            weak: keep only a weak reference (the receiver goes away with its owner).
            dispatch_uid: a key that makes connecting twice register once.
        """

        def register(function: Receiver) -> Receiver:
            key = dispatch_uid if dispatch_uid is not None else (_identity(function), _sender_key(sender))
            reference = _reference(function) if weak else (lambda: function)
            with self._lock:
                if all(existing != key for existing, _, _ in self._receivers):
                    self._receivers.append((key, reference, sender))
            return function

        return register(receiver) if receiver is not None else register

    def disconnect(
        self, receiver: Receiver | None = None, *, sender: Any = None, dispatch_uid: object = None
    ) -> bool:
        """Remove a receiver; True if one was registered."""
        key = dispatch_uid if dispatch_uid is not None else (_identity(receiver), _sender_key(sender))
        with self._lock:
            before = len(self._receivers)
            self._receivers = [entry for entry in self._receivers if entry[0] != key]
            return len(self._receivers) != before

    @property
    def has_receivers(self) -> bool:
        """Whether anything is connected (cheap: checked before building what a send would pass)."""
        return bool(self._receivers)

    @property
    def receivers(self) -> list[Receiver]:
        """The live receivers, in the order they were connected."""
        with self._lock:
            entries = list(self._receivers)
        return [function for _, reference, _ in entries if (function := reference()) is not None]

    def send(self, sender: Any, **named: Any) -> list[tuple[Receiver, Any]]:
        """Call every receiver that listens to ``sender``; what each returned (or raised).

        A receiver that raises is logged with its traceback; the others still run.
        """
        if not self._receivers:
            return []  # the common case, once per task and signal: no lock, no copy
        with self._lock:
            entries = list(self._receivers)
        responses: list[tuple[Receiver, Any]] = []
        for _, reference, wanted in entries:
            function = reference()
            if function is None or not _matches(wanted, sender):
                continue
            try:
                responses.append((function, function(signal=self, sender=sender, **named)))
            except Exception as exc:
                log.exception("signal_receiver_failed", signal=self.name, receiver=_name(function))
                responses.append((function, exc))
        return responses


def _reference(function: Receiver) -> Callable[[], Receiver | None]:
    if hasattr(function, "__self__") and hasattr(function, "__func__"):
        return weakref.WeakMethod(function)  # a bound method: a plain weakref would die at once
    try:
        return weakref.ref(function)
    except TypeError:  # not weakly referable (a builtin): keep it
        return lambda: function


def _identity(function: Receiver | None) -> object:
    if function is not None and hasattr(function, "__self__") and hasattr(function, "__func__"):
        return (id(function.__self__), id(function.__func__))
    return id(function)


def _sender_key(sender: Any) -> object:
    return None if sender is None else (_task_name(sender) or id(sender))


def _task_name(sender: Any) -> str | None:
    if isinstance(sender, str):
        return sender
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) and name else None


def _matches(wanted: Any, sender: Any) -> bool:
    if wanted is None or wanted is sender:
        return True
    name = _task_name(wanted)
    return name is not None and name == _task_name(sender)


def _name(function: Receiver) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


task_prerun = Signal("task_prerun", ("task_id", "task", "args", "kwargs"))
task_postrun = Signal("task_postrun", ("task_id", "task", "args", "kwargs", "retval", "state"))
task_success = Signal("task_success", ("result",))
task_failure = Signal("task_failure", ("task_id", "exception", "args", "kwargs", "traceback", "einfo"))
task_retry = Signal("task_retry", ("request", "reason", "einfo"))
worker_process_init = Signal("worker_process_init")
worker_ready = Signal("worker_ready")
worker_shutdown = Signal("worker_shutdown")
before_task_publish = Signal(
    "before_task_publish",
    ("body", "exchange", "routing_key", "headers", "properties", "declare", "retry_policy"),
)
after_task_publish = Signal("after_task_publish", ("body", "exchange", "routing_key", "headers"))
task_received = Signal("task_received", ("request",))
task_revoked = Signal("task_revoked", ("request", "terminated", "signum", "expired"))
