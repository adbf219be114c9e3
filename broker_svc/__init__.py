"""Clockwork's client library: tasks, publishing with confirms, results, and the shared wire parts.

Every export is loaded on first use (PEP 562): ``ctl`` and the worker's pool children import
``broker_svc.errors`` or ``broker_svc.settings`` without paying for the app, the canvas and pika
(``ctl`` starts in under a quarter of a second; BENCHMARKS.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.canvas.maps import chunks, xmap, xstarmap
    from broker_svc.canvas.signature import Signature, chain, chord, group, signature
    from broker_svc.canvas.stamping import StampingVisitor
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
        SpoolError,
        SpoolFull,
        TaskDeclined,
        TaskError,
        TaskRevokedError,
        TimeLimitExceeded,
        Unroutable,
    )
    from broker_svc.results.jobs import Job
    from broker_svc.results.result import AsyncResult, GroupResult, ResultSet
    from broker_svc.sending.publisher import Publisher
    from broker_svc.settings import Settings
    from broker_svc.tasks.shared import shared_task
    from broker_svc.tasks.task import Task
    from broker_svc.tasks.task_app import current_app
    from broker_svc.wire.records.task_state import JobState
    from broker_svc.wire.task.states import State
    from broker_svc.wire.task.task_message import TaskMessage

__all__ = [
    # the app and its tasks
    "App",
    "AsyncResult",
    "Signature",
    "State",
    "Task",
    # jobs and the task-state stream (docs/guide.md, "Jobs and states")
    "Job",
    "JobState",
    "current_app",
    "shared_task",
    # the canvas
    "GroupResult",
    "ResultSet",
    "StampingVisitor",
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
    "SpoolError",
    "SpoolFull",
    "TaskDeclined",
    "TaskError",
    "TaskRevokedError",
    "TimeLimitExceeded",
    "Unroutable",
]


_EXPORTS = {
    "App": "broker_svc.app",
    "AsyncResult": "broker_svc.results.result",
    "Job": "broker_svc.results.jobs",
    "JobState": "broker_svc.wire.records.task_state",
    "BrokerBlocked": "broker_svc.errors",
    "BrokerSvcError": "broker_svc.errors",
    "BrokerUnavailable": "broker_svc.errors",
    "ChordError": "broker_svc.errors",
    "ConfigurationError": "broker_svc.errors",
    "ContentDisallowed": "broker_svc.errors",
    "DecodeError": "broker_svc.errors",
    "GroupResult": "broker_svc.results.result",
    "Ignore": "broker_svc.errors",
    "InvalidTaskMessage": "broker_svc.errors",
    "LamportClock": "broker_svc.clock",
    "MaxRetriesExceededError": "broker_svc.errors",
    "MessageError": "broker_svc.errors",
    "MessageTooLarge": "broker_svc.errors",
    "NotRegistered": "broker_svc.errors",
    "PublishError": "broker_svc.errors",
    "PublishNacked": "broker_svc.errors",
    "Publisher": "broker_svc.sending.publisher",
    "Reject": "broker_svc.errors",
    "ResultSet": "broker_svc.results.result",
    "ResultTimeout": "broker_svc.errors",
    "Retry": "broker_svc.errors",
    "Settings": "broker_svc.settings",
    "Signature": "broker_svc.canvas.signature",
    "SoftTimeLimitExceeded": "broker_svc.errors",
    "SpoolError": "broker_svc.errors",
    "SpoolFull": "broker_svc.errors",
    "StampingVisitor": "broker_svc.canvas.stamping",
    "State": "broker_svc.wire.task.states",
    "Task": "broker_svc.tasks.task",
    "TaskDeclined": "broker_svc.errors",
    "TaskError": "broker_svc.errors",
    "TaskMessage": "broker_svc.wire.task.task_message",
    "TaskRevokedError": "broker_svc.errors",
    "TimeLimitExceeded": "broker_svc.errors",
    "Unroutable": "broker_svc.errors",
    "chain": "broker_svc.canvas.signature",
    "chord": "broker_svc.canvas.signature",
    "chunks": "broker_svc.canvas.maps",
    "current_app": "broker_svc.tasks.task_app",
    "group": "broker_svc.canvas.signature",
    "shared_task": "broker_svc.tasks.shared",
    "signature": "broker_svc.canvas.signature",
    "xmap": "broker_svc.canvas.maps",
    "xstarmap": "broker_svc.canvas.maps",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
