"""Celery's key-value result format (its Redis backend): key names, the stored meta, chord members.

Facts from Celery's ``celery/backends/base.py`` (``BaseKeyValueStoreBackend``) and
``celery/backends/redis.py``, so a Celery client, a Celery worker and ours read each other's keys:

- a task's state lives under ``celery-task-meta-<id>``, a chord's bookkeeping under
  ``celery-taskset-meta-<group id>`` plus a suffix (``.j`` the header's results, ``.t`` the
  tasks added to it, ``.s`` its size, ``.d`` the parts counted, ``.c`` the body's dispatch
  claim); ``result_backend_transport_options["global_keyprefix"]`` goes before each (with a
  ``_`` unless it ends in one of ``:_-.``);
- the value is the meta map below in the ``result_serializer`` (json by default), written with
  the key's expiry and PUBLISHed on a channel named as the key, where a waiting client listens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from broker_svc.wire.results.message import Outcome
from broker_svc.wire.task.task_message import TaskMessage

__all__ = [
    "CHORD_KEY_SUFFIXES",
    "REDIS_SCHEMES",
    "ResultKeys",
    "chord_member",
    "extended_fields",
    "is_redis_url",
    "result_meta",
]

TASK_KEY_PREFIX: Final = "celery-task-meta-"
GROUP_KEY_PREFIX: Final = "celery-taskset-meta-"
# A chord's keys beside its group key: results, added tasks, size, counted parts, dispatch claim.
CHORD_KEY_SUFFIXES: Final = (".j", ".t", ".s", ".d", ".c")
REDIS_SCHEMES: Final = frozenset({"redis", "rediss"})
_REDIS_PREFIXES: Final = tuple(f"{scheme}://" for scheme in sorted(REDIS_SCHEMES))


def is_redis_url(value: Any) -> bool:
    """Whether ``value`` names a Redis result backend (``redis://`` or ``rediss://``).

    Asked on every result handle a client makes, so a prefix test, as Celery reads the scheme.
    """
    return isinstance(value, str) and value.startswith(_REDIS_PREFIXES)


@dataclass(frozen=True, slots=True)
class ResultKeys:
    """The key names of one app's results, with its ``global_keyprefix`` (Celery's rule)."""

    prefix: str = ""

    @classmethod
    def from_transport_options(cls, options: Mapping[str, Any] | None) -> ResultKeys:
        """Keys for ``result_backend_transport_options`` (its ``global_keyprefix``)."""
        prefix = str((options or {}).get("global_keyprefix") or "")
        if prefix and prefix[-1] not in ":_-.":
            prefix += "_"
        return cls(prefix)

    def task(self, task_id: str) -> str:
        """The key (and PUBLISH channel) of a task's state.

        Raises:
            ValueError: an empty id (Celery refuses it too).
        """
        if not task_id:
            raise ValueError("a task id must not be empty")
        return f"{self.prefix}{TASK_KEY_PREFIX}{task_id}"

    def group(self, group_id: str, suffix: str = "") -> str:
        """The key of a group (a saved ``GroupResult``), or with a suffix one of its chord's keys.

        Raises:
            ValueError: an empty id.
        """
        if not group_id:
            raise ValueError("a group id must not be empty")
        return f"{self.prefix}{GROUP_KEY_PREFIX}{group_id}{suffix}"


def result_meta(
    outcome: Outcome, *, group_id: str | None, parent_id: str | None, extended: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The map Celery's key-value backends store for a state (``_get_result_meta`` + ``task_id``)."""
    wire = outcome.to_wire()
    meta: dict[str, Any] = {
        "status": wire["status"],
        "result": wire["result"],
        "traceback": wire["traceback"],
        "children": wire["children"],
        "date_done": wire["date_done"],
    }
    if group_id:
        meta["group_id"] = group_id
    if parent_id:
        meta["parent_id"] = parent_id
    if extended is not None:
        meta.update(extended)
    meta["task_id"] = outcome.task_id
    return meta


def extended_fields(request: TaskMessage, *, hostname: str, queue: str | None) -> dict[str, Any]:
    """``result_extended``'s fields of a request: name, args, kwargs, worker, retries, queue."""
    return {
        "name": request.task,
        "args": list(request.args),
        "kwargs": dict(request.kwargs),
        "worker": hostname,
        "retries": request.retries,
        "queue": queue,
    }


def chord_member(task_id: str, state: str, result: Any) -> list[Any]:
    """A header task's entry in its chord's ``.j`` set: ``[1, id, state, result]``."""
    return [1, task_id, state, result]
