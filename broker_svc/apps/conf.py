"""``app.conf``: Celery's setting names, over the app's ``Settings``.

A Celery app configures itself with ``app.conf.update(...)``, ``app.conf.task_routes = {...}`` or
``app.config_from_object(...)``. ``Config`` takes those names. The ones with a Clockwork field
(``broker_url``, ``task_serializer``, ...) change the app's ``Settings``; the ones Clockwork reads
elsewhere (``task_routes``, ``include``, ``beat_schedule``, ...) are kept here for their readers;
the ones Clockwork does by design (``task_acks_late``: it always acks after the run) are accepted.
A Celery setting that has no effect here is accepted with one warning naming it, never silently.
"""

from __future__ import annotations

import datetime as dt
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, Final

from broker_svc.errors import ConfigurationError
from broker_svc.logging import get_logger
from broker_svc.topology import SINGLE_ACTIVE_ARGUMENT
from broker_svc.wire.results.meta import is_redis_url

__all__ = ["ACCEPTED_AS_DESIGNED", "READ_BY_CLOCKWORK", "SETTINGS_FIELDS", "Config", "load_object"]

log = get_logger(__name__)


def _seconds(value: Any) -> int:
    if isinstance(value, dt.timedelta):
        return int(value.total_seconds())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    raise ConfigurationError(f"expected seconds or a timedelta, got {value!r}")


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


# Clockwork's result backend for Celery apps (broker_svc/celery_backend.py), by Celery's name for it.
CHORD_BACKEND: Final = "broker_svc.celery_backend:ChordBackend"


def _queue_arguments(entry: Any) -> tuple[str, dict[str, Any]]:
    # A ``task_queues`` entry: kombu's ``Queue`` (``name``, ``queue_arguments``) or a dict of them.
    if isinstance(entry, Mapping):
        name, arguments = entry.get("name"), entry.get("queue_arguments")
    else:
        name, arguments = getattr(entry, "name", None), getattr(entry, "queue_arguments", None)
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"task_queues: an entry without a queue name: {entry!r}")
    return name, dict(arguments or {})


def _task_queues(value: Any, ordered: tuple[str, ...]) -> dict[str, Any]:
    # Celery's ``task_queues``: the queue arguments Clockwork declares alike on both sides.
    # ``x-single-active-consumer`` makes an ordered queue, ``x-queue-type: quorum`` a quorum one.
    entries = [_queue_arguments(entry) for entry in (value or ())]
    single = [name for name, arguments in entries if arguments.get(SINGLE_ACTIVE_ARGUMENT) is True]
    quorum = [name for name, arguments in entries if arguments.get("x-queue-type") == "quorum"]
    fields: dict[str, Any] = {"ordered_queues": tuple(dict.fromkeys([*ordered, *single]))}
    if quorum:
        fields["quorum_queues"] = tuple(quorum)
    return fields


def _backend(value: Any) -> None:
    # Results travel on RabbitMQ, as Celery's rpc:// backend carries them, and with a redis:// URL
    # also in Redis, in Celery's Redis format (broker_svc/redis_results/). Any other store would be
    # a setting silently not honoured, so it is refused. Our Celery backend (rpc:// plus chords
    # joined by Clockwork workers) is what Clockwork's client does anyway.
    if value in (None, "rpc", "rpc://", CHORD_BACKEND):
        return
    if is_redis_url(value):
        if importlib.util.find_spec("redis") is None:
            raise ConfigurationError(
                f"result backend {value!r} needs the redis client library: "
                "pip install 'clockwork-tasks[redis]'"
            )
        return
    raise ConfigurationError(
        f"result backend {value!r} is not supported: Clockwork keeps results on RabbitMQ, as "
        "Celery's 'rpc://' backend does, or in Redis (a redis:// or rediss:// URL); use "
        "result_backend='rpc://', a Redis URL, or leave it unset"
    )


# Celery name → (Settings field, conversion).
SETTINGS_FIELDS: Final[Mapping[str, tuple[str, Callable[[Any], Any]]]] = {
    "broker_url": ("broker_url", str),
    "task_default_queue": ("default_queue", str),
    "task_serializer": ("serializer", str),
    "accept_content": ("accept_content", _names),
    "result_expires": ("result_expires_s", _seconds),
    "result_persistent": ("result_persistent", bool),
    # Clockwork's own: the task-state stream (docs/guide.md, "Jobs and states").
    "task_states": ("task_states", bool),
    "broker_heartbeat": ("heartbeat_s", int),
    "broker_connection_timeout": ("connect_timeout_s", float),
    # Clockwork's own: ordered task queues (docs/guide.md, "Ordered queues"); ``task_queues``
    # entries declared with ``x-single-active-consumer`` are ordered too.
    "task_ordered_queues": ("ordered_queues", _names),
    "task_queue_max_priority": ("queue_max_priority", int),
    # Clockwork's own: the producer's disk spool (docs/guide.md, "When the broker is down").
    "spool_dir": ("spool_dir", str),
    "spool_max_bytes": ("spool_max_bytes", int),
    "spool_memory_records": ("spool_memory_records", int),
    "spool_flush_count": ("spool_flush_count", int),
    "spool_flush_interval_s": ("spool_flush_interval_s", float),
    "spool_fsync": ("spool_fsync", bool),
    # Clockwork's own: the key of the app's shared state (docs/guide.md, "Many apps on one broker").
    "app_namespace": ("app_namespace", str),
}

# Celery names that Clockwork reads where they apply (routing, the worker, the scheduler).
READ_BY_CLOCKWORK: Final = frozenset(
    {
        "task_routes", "include", "imports", "beat_schedule", "result_backend", "task_ignore_result",
        "task_default_priority", "task_time_limit", "task_soft_time_limit", "worker_concurrency",
        "worker_prefetch_multiplier", "result_accept_content", "task_track_started",
        "worker_max_tasks_per_child", "worker_max_memory_per_child", "task_always_eager",
        "task_eager_propagates", "task_queues", "timezone",
        # Read by the Redis result backend (broker_svc/redis_results/backend_conf.py).
        "result_serializer", "result_extended", "result_failure_expires", "result_chord_expires",
        "result_chord_join_timeout", "result_backend_transport_options",
    }
)  # fmt: skip

# Celery names for what Clockwork always does: accepted, with nothing to change.
ACCEPTED_AS_DESIGNED: Final[Mapping[str, str]] = {
    "task_acks_late": "Clockwork always acks a task after its run",
    "task_reject_on_worker_lost": "a task whose child died is redelivered up to delivery_limit times",
    "task_acks_on_failure_or_timeout": "a failed task is acked after its FAILURE result is confirmed",
    "enable_utc": "Clockwork's timestamps are UTC",
    "broker_connection_retry_on_startup": "Clockwork's connections retry within reconnect_window_s",
    "broker_connection_retry": "Clockwork's connections retry within reconnect_window_s",
    "task_create_missing_queues": "a task queue is declared by whoever uses it first",
    "worker_hijack_root_logger": "Clockwork's worker replaces the root logger's handlers (Celery's default)",
    "task_protocol": "Clockwork speaks task protocol 2",
}

# A name with one of these prefixes is a Celery setting: if Clockwork does not use it, say so.
_CELERY_PREFIXES: Final = (
    "broker_", "task_", "worker_", "result_", "beat_", "event_", "control_", "security_", "cache_",
    "database_", "redis_", "mongodb_", "cassandra_", "s3_", "azureblob_", "elasticsearch_", "riak_",
    "couchbase_", "arangodb_", "cosmosdb_", "consul_", "filesystem_", "gcs_", "celeryd_", "celerybeat_",
)  # fmt: skip


class Config(MutableMapping[str, Any]):
    """A Celery app's settings by Celery's names, as ``app.conf`` (a mapping with attributes).

    Args:
        apply: called with the ``Settings`` fields changed by a setting, to rebuild the app's
            settings (it raises ``ConfigurationError`` for an invalid value, and the setting is
            then not stored).
    """

    def __init__(self, apply: Callable[[dict[str, Any]], None]) -> None:
        object.__setattr__(self, "_apply", apply)
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_warned", set())

    # -- mapping -------------------------------------------------------------------------------------

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def get(self, key: str, default: Any = None) -> Any:
        # Read on every send: a plain dict lookup, not Mapping.get's KeyError round trip.
        return self._values.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __setitem__(self, key: str, value: Any) -> None:
        self.update({key: value})

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"<Config {sorted(self._values)}>"

    # -- attributes, as Celery's conf has them --------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self.update({name: value})

    # -- writing -------------------------------------------------------------------------------------

    def update(self, other: Any = (), /, **kwargs: Any) -> None:
        """Set several settings at once; fields of ``Settings`` change together.

        Raises:
            ConfigurationError: a value is invalid (nothing is stored then).
        """
        changes = dict(other, **kwargs)
        fields: dict[str, Any] = {}
        for key, value in changes.items():
            if key in SETTINGS_FIELDS:
                field, convert = SETTINGS_FIELDS[key]
                try:
                    fields[field] = convert(value)
                except (TypeError, ValueError) as exc:
                    raise ConfigurationError(f"app.conf.{key}: {exc}") from None
            elif key == "result_backend":
                _backend(value)
        if "task_queues" in changes:
            ordered = _names(changes.get("task_ordered_queues", self._values.get("task_ordered_queues", ())))
            fields.update(_task_queues(changes["task_queues"], ordered))
        elif "task_ordered_queues" in changes and "task_queues" in self._values:
            fields.update(_task_queues(self._values["task_queues"], fields["ordered_queues"]))
        if fields:
            self._apply(fields)
        self._values.update(changes)
        for key in changes:
            self._note(key)

    def setdefault(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, set to ``default`` first if it has none."""
        if key not in self._values:
            self[key] = default
        return self._values[key]

    def from_object(self, obj: Any, *, namespace: str | None = None) -> None:
        """Take every upper- or lower-case setting of a module, class or object (or its dotted name).

        With ``namespace="CELERY"``, only ``CELERY_*`` names are read, without the prefix, as
        Celery reads a Django settings module.

        Raises:
            ImportError: a dotted name that does not import.
            ConfigurationError: a value is invalid.
        """
        source = load_object(obj) if isinstance(obj, str) else obj
        prefix = f"{namespace}_" if namespace else ""
        found: dict[str, Any] = {}
        for name in dir(source):
            if name.startswith("_") or not name.startswith(prefix):
                continue
            key = name[len(prefix) :]
            if key.isupper() or key.islower():
                found[key.lower()] = getattr(source, name)
        self.update(found)

    def _note(self, key: str) -> None:
        if key in SETTINGS_FIELDS or key in READ_BY_CLOCKWORK or key in ACCEPTED_AS_DESIGNED:
            return
        if key.startswith(_CELERY_PREFIXES) and key not in self._warned:
            self._warned.add(key)
            log.warning(
                "celery_setting_not_used",
                setting=key,
                hint="Clockwork accepts it but does not act on it; see docs/migrating-from-celery.md",
            )


def load_object(path: str) -> Any:
    """The object named ``package.module`` or ``package.module:attr`` (or ``package.module.attr``).

    Raises:
        ImportError: nothing by that name.
    """
    module_name, colon, attribute = path.partition(":")
    if not colon:
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError:
            module_name, _, attribute = path.rpartition(".")
            if not module_name:
                raise
    value: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ImportError(f"{module_name!r} has no attribute {attribute!r}", name=module_name) from None
    return value
