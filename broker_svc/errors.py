"""The error tree: every error Clockwork raises derives from ``BrokerSvcError``.

::

    BrokerSvcError
    ├── ConfigurationError (ValueError)      bad settings or URL
    ├── BrokerUnavailable (ConnectionError)  cannot reach or keep the broker
    ├── ResultBackendUnavailable             cannot reach the Redis result backend
    │   (ConnectionError)
    ├── PublishError                         a publish was not confirmed
    │   ├── PublishNacked                    the broker refused it (nack)
    │   ├── BrokerBlocked                    a memory or disk alarm held it past confirm_timeout_s
    │   ├── Unroutable                       no queue was bound for it (mandatory return)
    │   └── SpoolError                       the producer's disk spool cannot take the task
    │       └── SpoolFull                    over spool_max_bytes, or its disk is full
    ├── MessageError                         a message cannot be used as it is
    │   ├── ContentDisallowed                content type not in the accept list (pickle, yaml, ...)
    │   ├── DecodeError                      the body does not decode
    │   ├── MessageTooLarge (ValueError)     body over the configured limit
    │   └── InvalidTaskMessage               decodes, but is not a protocol-v2 task
    ├── NotRegistered (KeyError)             no task of that name in the app
    ├── ResultTimeout (TimeoutError)         ``AsyncResult.get`` ran out of time
    │   └── ResultUnreachable                ... while no connection reached the broker (also a
    │                                        BrokerUnavailable)
    ├── SoftTimeLimitExceeded                raised inside a task when its soft time limit passes
    ├── Retry                                raised by ``Task.retry()``: run this task again later
    ├── MaxRetriesExceededError              ``Task.retry()`` with no retries left and no ``exc``
    ├── Ignore                               raised by a task: ack it, record no state
    ├── Reject                               raised by a task: requeue it, or dead-letter it
    ├── TaskError                            a task failed remotely (carries the remote type)
    │   ├── TaskRevokedError                 the task was revoked or expired
    │   ├── TimeLimitExceeded                the task ran past its hard time limit and was ended
    │   ├── ChordError                       a chord's body did not run: a header task failed
    │   └── TaskDeclined                     not run: its dedup key had one running and one waiting
    ├── LeadershipLost                       this process is not (or no longer) the leader
    ├── PoolClosedError (RuntimeError)       the worker's pool is closing and takes no more jobs
    ├── PoolStartError (RuntimeError)        a pool child did not load the app or report ready
    ├── DeadLetterNotFound (KeyError)        no dead letter has that task id (``ctl dead``)
    └── DeadQueueBusy                        another caller reads or requeues that dead queue

The pool errors live in ``worker/pool/`` (``pool.py``, ``child.py``), since broker_svc never imports
the worker; they are drawn here so the whole tree is in one place.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

__all__ = [
    "BrokerBlocked",
    "BrokerSvcError",
    "BrokerUnavailable",
    "ChordError",
    "ConfigurationError",
    "ContentDisallowed",
    "DeadLetterNotFound",
    "DeadQueueBusy",
    "DecodeError",
    "Ignore",
    "InvalidTaskMessage",
    "LeadershipLost",
    "MaxRetriesExceededError",
    "MessageError",
    "MessageTooLarge",
    "NotRegistered",
    "PublishError",
    "PublishNacked",
    "Reject",
    "ResultBackendUnavailable",
    "ResultTimeout",
    "ResultUnreachable",
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


class BrokerSvcError(Exception):
    """Root of every error raised by Clockwork."""


class ConfigurationError(BrokerSvcError, ValueError):
    """Settings or a broker URL are invalid."""


class BrokerUnavailable(BrokerSvcError, ConnectionError):
    """The broker could not be reached, or the connection was lost for good."""


class ResultBackendUnavailable(BrokerSvcError, ConnectionError):
    """The Redis result backend could not be reached, or refused a write, within its retries."""


class LeadershipLost(BrokerSvcError):
    """This process is not, or no longer, the leader: its term's actions must stop.

    Raised by ``Term.guard()`` once the term's lease ran out or it stepped down, and into a running
    ``execute()`` hook of an atomic election when its term ends (``worker/leader/``).
    """


class PublishError(BrokerSvcError):
    """A message was not confirmed by the broker."""


class PublishNacked(PublishError):
    """The broker answered a publish with basic.nack."""


class BrokerBlocked(PublishError):
    """The broker blocked the connection (a memory or disk alarm) and the publish timed out.

    A message that was already written to the socket may still be enqueued once the alarm clears,
    so sending it again can duplicate it (same task id: at-least-once).
    """


class Unroutable(PublishError):
    """The broker returned a mandatory publish: no queue is bound for its routing key."""


class SpoolError(PublishError):
    """The producer's spool (``spool_dir``) cannot take a task: it cannot be opened or written.

    The task was not accepted; tasks accepted before stay in the spool.
    """


class SpoolFull(SpoolError):
    """The spool holds ``spool_max_bytes`` already, or its disk is full: the task was not accepted.

    Nothing accepted earlier is dropped; the spool takes tasks again once the broker has taken
    some (or space is freed on the disk).
    """


class MessageError(BrokerSvcError):
    """A message (task, result or control) cannot be used as it is."""


class ContentDisallowed(MessageError):
    """The content type is not in the accept list; the body was not decoded."""


class DecodeError(MessageError):
    """The body does not decode with its declared content type."""


class MessageTooLarge(MessageError, ValueError):
    """The body is larger than the configured limit."""


class InvalidTaskMessage(MessageError):
    """The message decodes but is not a valid protocol-v2 task."""


class NotRegistered(BrokerSvcError, KeyError):
    """No task with this name is registered in the app."""

    def __str__(self) -> str:
        # KeyError's str() adds quotes; keep the plain name, as Celery shows it.
        return str(self.args[0]) if self.args else ""


class ResultTimeout(BrokerSvcError, TimeoutError):
    """A result did not arrive within the timeout."""


class ResultUnreachable(BrokerUnavailable, ResultTimeout):
    """A result did not arrive within the timeout, and the client has no connection to the broker.

    Both a ``BrokerUnavailable`` (the reason, naming the broker's redacted URL) and a
    ``ResultTimeout``, so code that waits for a timeout still catches it.
    """


class SoftTimeLimitExceeded(BrokerSvcError):
    """Raised inside a task when its soft time limit passes; the task may catch it to clean up.

    On the wire it is Celery's ``celery.exceptions.SoftTimeLimitExceeded``.
    """


class TaskError(BrokerSvcError):
    """A task failed on a worker.

    ``AsyncResult.get()`` raises a subclass of this *and* of the remote exception type when that
    type is a builtin (so ``except ValueError`` works), else a plain ``TaskError``.

    Attributes:
        exc_type: the remote exception's class name (``"ValueError"``).
        exc_module: the remote exception's module (``"builtins"``).
        remote_traceback: the remote traceback text, if the worker sent one.
    """

    exc_type: str = ""
    exc_module: str = ""
    remote_traceback: str | None = None


class TaskRevokedError(TaskError):
    """The task was revoked, expired or terminated before it finished."""


class TimeLimitExceeded(TaskError):
    """The task ran past its hard time limit and was ended (Celery's ``celery.exceptions`` name).

    Its one argument is the limit in seconds, as in Celery (``TimeLimitExceeded(2.0)``), and that
    is what the wire carries (``exc_message`` ``[2.0]``), so Celery clients rebuild their own type;
    only the text is for people: ``task exceeded its hard time limit of 2.0 s``.
    """

    def __str__(self) -> str:
        limit = self.args[0] if len(self.args) == 1 else None
        if isinstance(limit, int | float) and not isinstance(limit, bool):
            return f"task exceeded its hard time limit of {float(limit)} s"
        return super().__str__()


class ChordError(TaskError):
    """A chord's body did not run because a task of its header failed (Celery's ``ChordError``)."""


class TaskDeclined(TaskError):
    """The task was not run: its dedup key (``dedup_key``) had a call running and one waiting.

    Keyed deduplication lets one call per key run, cluster-wide, and keeps at most one more
    waiting; any other call with that key is declined and never runs. Its result's state is
    ``DECLINED`` (a ready state that is neither successful nor failed), and ``get()`` raises this.
    """


class Retry(BrokerSvcError):
    """Raised by ``Task.retry()``; the worker sends the task again and records RETRY.

    Attributes:
        exc: the error that caused the retry, if any.
        eta: when the next attempt may start (timezone-aware).
        call_args: the next attempt's positional arguments, when ``retry(args=...)`` changed them.
        call_kwargs: its keyword arguments, when ``retry(kwargs=...)`` changed them.
    """

    def __init__(
        self,
        message: str,
        *,
        exc: BaseException | None,
        eta: dt.datetime,
        call_args: tuple[Any, ...] | None = None,
        call_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.exc = exc
        self.eta = eta
        self.call_args = call_args
        self.call_kwargs = call_kwargs


class MaxRetriesExceededError(BrokerSvcError):
    """``Task.retry()`` was called with no retries left (and no ``exc`` to raise instead)."""


class Ignore(BrokerSvcError):
    """Raised by a task that handled its own outcome: the worker acks it and sends no result."""


class Reject(BrokerSvcError):
    """Raised by a task to give its message back (Celery's ``Reject``).

    With ``requeue=True`` the message goes back to its queue and runs again; otherwise it is
    dead-lettered to ``<queue>.dead`` with ``reason``, and its caller gets a FAILURE.

    Attributes:
        reason: why, in words or as the exception that caused it.
        requeue: put it back in its queue instead of dead-lettering it.
    """

    def __init__(self, reason: object = None, requeue: bool = False) -> None:
        super().__init__(reason, requeue)
        self.reason = reason
        self.requeue = requeue


class DeadLetterNotFound(BrokerSvcError, KeyError):
    """No dead letter has these task ids (in the dead queues looked at); nothing was changed.

    Attributes:
        ids: the ids not found.
        queues: the dead queues looked in.
    """

    def __init__(self, ids: list[str], queues: list[str]) -> None:
        self.ids = ids
        self.queues = queues
        where = ", ".join(queues) if queues else "no dead queue (none found)"
        super().__init__(f"no dead letter with id {', '.join(ids)} in {where}")

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError's str() would quote it


class DeadQueueBusy(BrokerSvcError):
    """Another ``ctl dead`` (or program) holds the dead queue's lock: it is reading or requeueing it."""
