"""A worker's settings by Celery's names, as ``inspect conf`` and ``inspect report`` answer them.

Celery's ``conf`` lists its settings table: without defaults (the default), the settings that
differ from Celery's defaults; with them, every setting. Ours answers each Celery setting the
worker has a value for with what it does: its options, the app's ``Settings`` and ``app.conf``,
and what Clockwork always does (``task_acks_late`` is True: it acks after the run whatever the
setting says). Settings the app set that Clockwork does not use are left out (the worker warned of
each when the app was configured): listing them would claim an effect they do not have.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from typing import Any, Final

from broker_svc.app import App
from broker_svc.apps.conf import ACCEPTED_AS_DESIGNED, READ_BY_CLOCKWORK, SETTINGS_FIELDS
from broker_svc.topology import node_queue
from worker.config import WorkerConfig

__all__ = ["CELERY_DEFAULTS", "conf_table", "plain"]

# Celery 5.7's defaults (celery/app/defaults.py) of the settings a worker here has a value for;
# ``without defaults`` compares with them. Durations in seconds, as ours.
CELERY_DEFAULTS: Final[Mapping[str, Any]] = {
    "accept_content": ["json"], "result_accept_content": None, "enable_utc": True, "imports": [],
    "include": [], "timezone": None, "beat_schedule": {}, "broker_url": None,
    "broker_connection_timeout": 4, "broker_connection_retry": True,
    "broker_connection_retry_on_startup": None, "broker_heartbeat": 120, "broker_use_ssl": False,
    "control_exchange": "celery", "control_queue_ttl": 300.0, "control_queue_expires": 10.0,
    "control_queue_exclusive": True, "control_queue_durable": False, "event_exchange": "celeryev",
    "event_serializer": "json", "result_backend": None, "result_expires": 86_400,
    "result_persistent": None, "task_acks_late": False, "task_acks_on_failure_or_timeout": True,
    "task_reject_on_worker_lost": None, "task_always_eager": False, "task_eager_propagates": False,
    "task_create_missing_queues": True, "task_default_delivery_mode": 2,
    "task_default_exchange": None, "task_default_exchange_type": "direct",
    "task_default_priority": None, "task_default_queue": "celery", "task_default_rate_limit": None,
    "task_default_routing_key": None, "task_ignore_result": False, "task_protocol": 2,
    "task_queue_max_priority": None, "task_queues": None, "task_routes": None,
    "task_serializer": "json", "task_soft_time_limit": None, "task_time_limit": None,
    "task_track_started": False, "worker_concurrency": None, "worker_direct": False,
    "worker_disable_rate_limits": False, "worker_enable_remote_control": True,
    "worker_hijack_root_logger": True, "worker_max_memory_per_child": None,
    "worker_max_tasks_per_child": None, "worker_pool": "prefork", "worker_prefetch_multiplier": 4,
    "worker_send_task_events": False, "worker_state_db": None,
}  # fmt: skip

# Celery masks settings whose names look secret (celery/app/utils.py), and so do we.
_HIDDEN: Final = re.compile("API|TOKEN|KEY|SECRET|PASS|PROFANITIES_LIST|SIGNATURE|DATABASE|BEAT_DBURI", re.I)
_MASK: Final = "********"


def conf_table(app: App, config: WorkerConfig, *, task_events: bool, with_defaults: bool) -> dict[str, Any]:
    """The worker's settings by Celery's names, JSON-ready (``inspect conf``).

    Args:
        app: the worker's app (its ``app.conf``).
        config: the worker's options and settings.
        task_events: whether task events are on now (``enable_events`` changes it).
        with_defaults: every setting; else those that differ from Celery's defaults or the app set.
    """
    table = _effective(app, config, task_events=task_events)
    used = SETTINGS_FIELDS.keys() | READ_BY_CLOCKWORK | ACCEPTED_AS_DESIGNED.keys()
    for key in app.conf:
        if key in used and key not in table:  # Clockwork's own settings (``task_states``, ...)
            table[key] = app.conf[key]
    if not with_defaults:
        table = {
            key: value
            for key, value in table.items()
            if key in app.conf or key not in CELERY_DEFAULTS or plain(value) != CELERY_DEFAULTS[key]
        }
    return {key: _MASK if _HIDDEN.search(key) else plain(value) for key, value in table.items()}


def _effective(app: App, config: WorkerConfig, *, task_events: bool) -> dict[str, Any]:
    settings, conf = config.settings, app.conf
    mailbox = node_queue(config.hostname, config.namespace).arguments
    heartbeat = settings.heartbeat_s if config.broker_heartbeat_s is None else config.broker_heartbeat_s
    return {
        # The app's Settings and the worker's options.
        "broker_url": settings.safe_broker_url,
        "broker_connection_timeout": settings.connect_timeout_s,
        "broker_heartbeat": heartbeat,
        "broker_use_ssl": any(url.startswith("amqps:") for url in settings.broker_urls),
        "accept_content": list(settings.accept_content),
        "result_accept_content": list(settings.accept_content),
        "task_serializer": settings.serializer,
        "task_default_queue": settings.default_queue,
        # Each task queue is bound to a direct exchange of its own name (broker_svc/topology.py):
        # Celery's default, where the default exchange and routing key (None) are the queue's name.
        "task_default_exchange": None,
        "task_default_exchange_type": "direct",
        "task_default_routing_key": None,
        "task_queue_max_priority": settings.queue_max_priority,
        "result_backend": conf.get("result_backend") or "rpc://",
        "result_expires": settings.result_expires_s,
        "result_persistent": settings.result_persistent,
        "task_time_limit": config.time_limit_s,
        "task_soft_time_limit": config.soft_time_limit_s,
        "worker_concurrency": config.concurrency,
        "worker_prefetch_multiplier": config.prefetch_multiplier,
        "worker_max_tasks_per_child": config.max_tasks_per_child,
        "worker_max_memory_per_child": config.max_memory_per_child_kib,
        "worker_send_task_events": task_events,
        "worker_state_db": str(config.state_path) if config.state_path is not None else None,
        "control_exchange": config.namespace,
        "control_queue_ttl": mailbox["x-message-ttl"] / 1000,
        "control_queue_expires": mailbox["x-expires"] / 1000,
        "control_queue_exclusive": True,
        "control_queue_durable": False,
        # app.conf, as the worker reads it.
        "imports": list(conf.get("imports") or ()),
        # The modules the worker imported for tasks: the app's (-A), then the app's ``include``
        # (Celery lists its worker's app module there too).
        "include": list(dict.fromkeys([config.app_spec.partition(":")[0], *(conf.get("include") or ())])),
        "timezone": conf.get("timezone"),
        "beat_schedule": conf.get("beat_schedule") or {},
        "task_routes": conf.get("task_routes"),
        "task_queues": conf.get("task_queues"),
        "task_default_priority": conf.get("task_default_priority"),
        "task_ignore_result": bool(conf.get("task_ignore_result", False)),
        "task_track_started": bool(conf.get("task_track_started", False)),
        "task_always_eager": bool(conf.get("task_always_eager", False)),
        "task_eager_propagates": bool(conf.get("task_eager_propagates", False)),
        # What Clockwork always does, whatever the app's conf says.
        "task_acks_late": True,
        "task_acks_on_failure_or_timeout": True,
        "task_reject_on_worker_lost": True,
        "task_create_missing_queues": True,
        "task_protocol": 2,
        "task_default_delivery_mode": 2,
        "task_default_rate_limit": None,
        "enable_utc": True,
        "broker_connection_retry": True,
        "broker_connection_retry_on_startup": True,
        "event_exchange": "celeryev",
        "event_serializer": "json",
        "worker_pool": "prefork",
        "worker_direct": False,
        "worker_disable_rate_limits": False,
        "worker_enable_remote_control": True,
        # The worker's entry point replaces the root logger's handlers (broker_svc/logging.py).
        "worker_hijack_root_logger": True,
    }


def plain(value: Any) -> Any:
    """``value`` as JSON can carry it, as Celery's ``jsonify`` turns settings (a repr for the rest)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return str(value)
    text = repr(value)
    return text if len(text) <= 1024 else text[:1021] + "..."
