"""Clockwork's client library: tasks, publishing with confirms, results, and the shared wire parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.app import App
from broker_svc.canvas import Signature, chain, chord, chunks, group, signature, xmap, xstarmap
from broker_svc.clock import LamportClock
from broker_svc.errors import (
    BrokerBlocked,
    BrokerSvcError,
    BrokerUnavailable,
    ChordError,
    ConfigurationError,
    ContentDisallowed,
    DecodeError,
    Ignore,
    InvalidTaskMessage,
    MaxRetriesExceededError,
    MessageError,
    MessageTooLarge,
    NotRegistered,
    PublishError,
    PublishNacked,
    Reject,
    ResultTimeout,
    Retry,
    SoftTimeLimitExceeded,
    TaskError,
    TaskRevokedError,
    Unroutable,
)
from broker_svc.group_result import GroupResult, ResultSet
from broker_svc.lazy_exports import lazy_exports
from broker_svc.result import AsyncResult
from broker_svc.settings import Settings
from broker_svc.shared import current_app, shared_task
from broker_svc.task import Task
from broker_svc.wire.states import State
from broker_svc.wire.task_message import TaskMessage

__all__ = [
    # the app and its tasks
    "App",
    "AsyncResult",
    "Signature",
    "State",
    "Task",
    "current_app",
    "shared_task",
    # the canvas
    "GroupResult",
    "ResultSet",
    "chain",
    "chord",
    "chunks",
    "group",
    "signature",
    "xmap",
    "xstarmap",
    # publishing and configuration
    "LamportClock",
    "Publisher",
    "Settings",
    "TaskMessage",
    # errors
    "BrokerBlocked",
    "BrokerSvcError",
    "BrokerUnavailable",
    "ChordError",
    "ConfigurationError",
    "ContentDisallowed",
    "DecodeError",
    "Ignore",
    "InvalidTaskMessage",
    "MaxRetriesExceededError",
    "MessageError",
    "MessageTooLarge",
    "NotRegistered",
    "PublishError",
    "PublishNacked",
    "Reject",
    "ResultTimeout",
    "Retry",
    "SoftTimeLimitExceeded",
    "TaskError",
    "TaskRevokedError",
    "Unroutable",
]


if TYPE_CHECKING:
    from broker_svc.publisher import Publisher


# Publisher brings pika in: loaded on first use, so a worker importing an app does not pay for it.
__getattr__ = lazy_exports(__name__, {"Publisher": "broker_svc.publisher"})
