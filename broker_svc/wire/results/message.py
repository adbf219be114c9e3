"""Results on the wire (Celery's ``rpc://`` body) and the mapping of exceptions to and from it."""

from __future__ import annotations

import builtins
import datetime as dt
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from broker_svc.errors import (
    ChordError,
    MessageError,
    NotRegistered,
    Reject,
    SoftTimeLimitExceeded,
    TaskError,
    TaskRevokedError,
    TimeLimitExceeded,
)
from broker_svc.wire.task.states import READY_STATES

__all__ = [
    "CELERY_EXCEPTIONS_MODULE",
    "Outcome",
    "describe_wire_exception",
    "exception_from_wire",
    "exception_to_wire",
    "wire_exception",
]

# Errors the worker itself reports carry Celery's module and names, so a Celery client rebuilds
# them as its own types and ours maps them back to Clockwork's (WIRE.md §4).
CELERY_EXCEPTIONS_MODULE: Final = "celery.exceptions"

_PRIMITIVES: Final = (str, int, float, bool, type(None))


def wire_exception(exc_type: str, *args: Any, module: str = CELERY_EXCEPTIONS_MODULE) -> dict[str, Any]:
    """An exception map for an error that exists only by name (``TaskRevokedError``, ...)."""
    return {"exc_type": exc_type, "exc_message": list(args), "exc_module": module}


def describe_wire_exception(error: Mapping[str, Any] | None) -> str:
    """An exception map in one line, ``Type: message`` (log lines, dead-letter reasons)."""
    if not error:
        return "unknown error"
    message = error.get("exc_message")
    known = _CELERY_NAMES.get(str(error.get("exc_type")))
    if known is not None and error.get("exc_module") == CELERY_EXCEPTIONS_MODULE:
        # Celery's args are for programs (a time limit is its seconds): say it in words.
        return f"{error.get('exc_type')}: {known(*message) if isinstance(message, list) else known(message)}"
    text = ", ".join(map(str, message)) if isinstance(message, list) else str(message)
    return f"{error.get('exc_type')}: {text}"


def exception_to_wire(exc: BaseException) -> dict[str, Any]:
    """Celery's exception map: ``{exc_type, exc_message (the args), exc_module}``.

    Arguments that are not plain values are sent as their ``repr`` so any codec can carry them.
    """
    args = [a if isinstance(a, _PRIMITIVES) else repr(a) for a in exc.args]
    # Our own stand-ins for Celery's errors go out under Celery's names, so Celery clients
    # rebuild their own types from the map.
    celery_name = _CELERY_WIRE_NAMES.get(type(exc))
    if celery_name is not None:
        return {"exc_type": celery_name, "exc_message": args, "exc_module": CELERY_EXCEPTIONS_MODULE}
    return {
        "exc_type": type(exc).__qualname__,
        "exc_message": args,
        "exc_module": type(exc).__module__,
    }


_CELERY_WIRE_NAMES: Final[dict[type[BaseException], str]] = {
    SoftTimeLimitExceeded: "SoftTimeLimitExceeded",
    TimeLimitExceeded: "TimeLimitExceeded",
    Reject: "Reject",
}


_remote_types: dict[tuple[str, str], type[TaskError]] = {}
_remote_types_lock = threading.Lock()

_CELERY_NAMES: Final[dict[str, type[TaskError]]] = {
    "TaskRevokedError": TaskRevokedError,
    "ChordError": ChordError,
    "TimeLimitExceeded": TimeLimitExceeded,
}


def exception_from_wire(value: Any, traceback: str | None = None) -> TaskError:
    """Rebuild a remote exception without importing anything.

    The result is a ``TaskError`` that is also an instance of the remote type when that type is a
    builtin or already imported here, so ``except ValueError`` keeps working after ``get()``.
    """
    if not isinstance(value, Mapping):
        error = TaskError(repr(value))
        error.exc_type, error.exc_module = "TaskError", "clockwork"
        error.remote_traceback = traceback
        return error
    exc_type = str(value.get("exc_type") or "Exception")
    exc_module = str(value.get("exc_module") or "builtins")
    raw_args = value.get("exc_message", [])
    args = tuple(raw_args) if isinstance(raw_args, list | tuple) else (raw_args,)
    cls = _remote_type(exc_type, exc_module)
    try:
        error = cls(*args)
    except Exception:  # an exotic __init__ signature: keep the text, lose the type
        error = TaskError(*args)
    error.exc_type, error.exc_module = exc_type, exc_module
    error.remote_traceback = traceback
    return error


def _remote_type(exc_type: str, exc_module: str) -> type[TaskError]:
    key = (exc_module, exc_type)
    with _remote_types_lock:
        cached = _remote_types.get(key)
        if cached is not None:
            return cached
        cls = _build_remote_type(exc_type, exc_module)
        _remote_types[key] = cls
        return cls


# Celery re-exports billiard's pool errors: a Celery worker's result names billiard's module.
_BILLIARD_EXCEPTIONS_MODULE: Final = "billiard.exceptions"


def _build_remote_type(exc_type: str, exc_module: str) -> type[TaskError]:
    if exc_module == _BILLIARD_EXCEPTIONS_MODULE and exc_type == "TimeLimitExceeded":
        return TimeLimitExceeded
    if exc_module == CELERY_EXCEPTIONS_MODULE:
        if exc_type in _CELERY_NAMES:
            return _CELERY_NAMES[exc_type]
        if exc_type == "NotRegistered":
            return type("NotRegistered", (TaskError, NotRegistered), {})
    local: object = None
    if exc_module == "builtins":
        local = getattr(builtins, exc_type, None)
    elif exc_module in sys.modules and "." not in exc_type:
        # Only modules this process already imported: a result must never trigger an import.
        local = getattr(sys.modules[exc_module], exc_type, None)
    name = exc_type.rsplit(".", 1)[-1] or "RemoteError"
    if isinstance(local, type) and issubclass(local, TaskError):
        return local  # one of Clockwork's remote errors (``TaskDeclined``...): itself, so ``except`` works
    if isinstance(local, type) and issubclass(local, Exception):
        try:
            return type(name, (TaskError, local), {"__module__": exc_module})
        except TypeError:  # incompatible instance layouts (e.g. OSError subclasses)
            pass
    return type(name, (TaskError,), {"__module__": exc_module})


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One result message: the state of a task as the ``rpc://`` backend publishes it."""

    task_id: str
    status: str
    result: Any = None
    traceback: str | None = None
    children: list[Any] = field(default_factory=list)
    date_done: str | None = None

    @property
    def ready(self) -> bool:
        """True for SUCCESS, FAILURE, REVOKED and DECLINED (``READY_STATES``)."""
        return self.status in READY_STATES

    def to_wire(self) -> dict[str, Any]:
        """The body map Celery's rpc backend sends (plus ``date_done`` as on Celery ``main``)."""
        date_done = self.date_done
        if date_done is None and self.ready:
            date_done = dt.datetime.now(dt.UTC).isoformat()
        return {
            "task_id": self.task_id,
            "status": str(self.status),
            "result": self.result,
            "traceback": self.traceback,
            "children": self.children,
            "date_done": date_done,
        }

    @classmethod
    def from_wire(cls, body: Any, *, correlation_id: str | None = None) -> Outcome:
        """Validate a decoded result body.

        Raises:
            MessageError: the body is not a result map.
        """
        if not isinstance(body, Mapping):
            raise MessageError(f"result body must be a map, got {type(body).__name__}")
        task_id = body.get("task_id") or correlation_id
        if not isinstance(task_id, str):
            raise MessageError("result has no task_id")
        status = body.get("status")
        if not isinstance(status, str) or not status:
            # Custom states (``update_state(state="PROGRESS")``) are any non-empty string.
            raise MessageError(f"result status must be a non-empty string, got {status!r}")
        traceback = body.get("traceback")
        children = body.get("children")
        return cls(
            task_id=task_id,
            status=status,
            result=body.get("result"),
            traceback=traceback if isinstance(traceback, str) else None,
            children=list(children) if isinstance(children, list) else [],
            date_done=body.get("date_done") if isinstance(body.get("date_done"), str) else None,
        )
