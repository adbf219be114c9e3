"""Jobs: RQ's job API over Clockwork tasks (``app.jobs``, ``app.enqueue``) and the task-state stream.

``Jobs.status`` answers from the stream (``topology.task_states_stream``) through one background
reader per app (``broker_svc/connection/state_feed.py``), so any process can ask about any task,
including tasks it did not send, and tell UNKNOWN (never seen within retention) from QUEUED.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

from broker_svc.canvas.signature import Signature
from broker_svc.errors import ConfigurationError
from broker_svc.results.result import AsyncResult
from broker_svc.sending.message import CLIENT_HOSTNAME, build_message, state_publish
from broker_svc.tasks.task_app import TaskApp
from broker_svc.topology import DEFAULT_EXCHANGE, QueueSpec, dependents_queue, task_states_stream
from broker_svc.wire.records.task_state import (
    ALLOW_FAILURE_HEADER,
    DEPENDS_ON_HEADER,
    FINAL_STATES,
    RESULT_TTL_HEADER,
    TARGET_QUEUE_HEADER,
    JobState,
    StateRecord,
)
from broker_svc.wire.results.meta import is_redis_url
from broker_svc.wire.task.task_message import encode_task

if TYPE_CHECKING:
    from broker_svc.clock import LamportClock
    from broker_svc.connection.state_feed import StateFeed
    from broker_svc.results.store import ResultStore
    from broker_svc.sending.producer import Producer
    from broker_svc.tasks.task import Task

__all__ = ["AT_FRONT_PRIORITY", "RESULT_TTL_HEADER", "Job", "Jobs", "latest_state"]

# ``at_front=True`` sends with this priority: ahead of lower ones in a queue declared with
# ``x-max-priority`` (``Settings.queue_max_priority``; Celery's usual 10 levels). Without it, task
# queues are declared as Celery's default, where priorities are ignored: docs/guide.md, "Jobs and states".
AT_FRONT_PRIORITY: Final = 9


def latest_state(history: Sequence[StateRecord]) -> str:
    """The state a history (in Lamport order) ends in; UNKNOWN for none.

    A task deleted while queued stays DELETED when a worker later skips it (REVOKED).
    """
    if not history:
        return JobState.UNKNOWN.value
    state = history[-1].state
    if state == JobState.REVOKED and any(record.state == JobState.DELETED for record in history):
        return JobState.DELETED.value
    return state


class JobsApp(TaskApp, Protocol):
    """What ``Jobs`` uses of its app (an ``App``) beyond what a task does: its clock, and its tasks
    as ``Task``s (``TaskApp`` cannot name ``Task``)."""

    @property
    def clock(self) -> LamportClock: ...

    @property
    def tasks(self) -> Mapping[str, Task]: ...


class Jobs:
    """``app.jobs``: task states from the stream, and RQ's calls (enqueue, fetch, cancel, delete).

    Args:
        app: the app whose broker, clock and control are used.
        store: the app's result store, where an enqueued job's result comes.
        producer: the app's producer (made on the first call), which publishes jobs and states.
    """

    def __init__(self, app: JobsApp, *, store: ResultStore, producer: Callable[[], Producer]) -> None:
        self._app = app
        self._store = store
        self._producer = producer
        self._feed: StateFeed | None = None
        self._lock = threading.Lock()

    # -- reading the stream ----------------------------------------------------------------------

    def history(self, task_id: str, *, timeout: float = 10.0) -> list[StateRecord]:
        """Every record of ``task_id`` on the stream (within retention), in order.

        A task this process sent is read after its QUEUED record: once the broker confirmed that
        record, the marker the reader appends next lands behind it on the stream, so the answer
        holds it (read-your-writes; without the wait, a status asked right after ``delay()`` could
        read up to a marker that overtook the record, and answer UNKNOWN).

        Raises:
            BrokerUnavailable: the stream could not be read up to now within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        record = self._store.queued_record(task_id)
        if record is not None:
            record.wait(timeout)  # a failed or late one: the stream answers what it has
        return self._ensure_feed().history(task_id, timeout=max(0.0, deadline - time.monotonic()))

    def status(self, task_id: str, *, timeout: float = 10.0) -> str:
        """The task's latest state: QUEUED, STARTED, RETRY, SUCCESS, FAILURE, REVOKED, DELETED,
        WAITING, DECLINED, or UNKNOWN when the stream has no record of it.

        Raises:
            BrokerUnavailable: the stream could not be read up to now within ``timeout``.
        """
        return latest_state(self.history(task_id, timeout=timeout))

    def fetch(self, job_id: str) -> Job:
        """A job by id, as RQ's ``Job.fetch`` (its status comes from the stream).

        With a Redis result backend its result is read there, so ``result`` and ``get()`` work in
        any process, as in RQ; on ``rpc://`` only the process that enqueued it gets its result.
        """
        if is_redis_url(self._app.conf.get("result_backend")):
            return Job(self, job_id, result=AsyncResult(job_id, store=self._store))
        return Job(self, job_id)

    # -- sending ---------------------------------------------------------------------------------

    def enqueue(
        self,
        f: Callable[..., Any] | str,
        *args: Any,
        job_id: str | None = None,
        ttl: float | None = None,
        result_ttl: float | None = None,
        at_front: bool = False,
        queue: str | None = None,
        depends_on: Iterable[Job | AsyncResult | str] | Job | AsyncResult | str | None = None,
        allow_failure: bool = False,
        **kwargs: Any,
    ) -> Job:
        """Send a task, RQ's way: ``app.enqueue(add, 1, 2, job_id="a", ttl=60)``.

        Args:
            f: a task (or its function, or its name).
            *args: the task's positional arguments.
            job_id: the task id (else a new uuid).
            ttl: seconds it may wait in its queue before it is dropped unrun (``expires``).
            result_ttl: seconds its result may wait for its reader (the result message's expiration);
                0 keeps no result, -1 (or None) keeps it as long as the result queue lives.
            at_front: sent with priority ``AT_FRONT_PRIORITY`` (needs a priority queue).
            queue: the queue (else the task's route).
            depends_on: jobs (or ids) that must finish first; the task waits on the broker (WAITING)
                and a worker sends it on once they all did, even if this process has exited.
            allow_failure: run it even when a dependency failed or was revoked (else it is dropped,
                REVOKED, and its caller gets a FAILURE).
            **kwargs: the task's keyword arguments.

        Raises:
            ConfigurationError: ``task_states`` is off (a job's status would always be UNKNOWN).
            TypeError: the arguments do not fit the task, or ``depends_on`` for a task with a
                ``dedup_key`` (a task's own key applies to ``enqueue`` without ``depends_on``).
        """
        if not self._app.settings.task_states:
            raise ConfigurationError("app.enqueue needs task_states=True (app.conf or CLOCKWORK_TASK_STATES)")
        name = self._task_name(f)
        options: dict[str, Any] = {}
        if job_id is not None:
            options["task_id"] = job_id
        if ttl is not None:
            options["expires"] = float(ttl)
        if at_front:
            options["priority"] = AT_FRONT_PRIORITY
        if queue is not None:
            options["queue"] = queue
        if result_ttl is not None:
            if result_ttl == 0:
                options["ignore_result"] = True
            elif result_ttl > 0:
                options["headers"] = {RESULT_TTL_HEADER: int(result_ttl * 1000)}
        task = self._app.tasks.get(name)
        if task is not None:
            # Routed as delay() routes it: its declaration's options under this call's.
            options = {**task.send_options(), **options}
            if task.typing:
                task.check_arguments(args, kwargs)
        if depends_on is not None:
            items = [depends_on] if isinstance(depends_on, str | Job | AsyncResult) else list(depends_on)
            if items:
                if task is not None and task._dedup is not None and task._dedup.keyed:
                    # A dependent is sent on by a worker, from the dependents queue, not the gate.
                    raise TypeError(f"task {name!r} has a dedup_key: depends_on cannot hold it back too")
                return self._enqueue_dependent(Signature(name, args, kwargs, options), items, allow_failure)
        result = self._app.send_task(name, args, kwargs, **options)
        return Job(self, result.id, result=result)

    def _enqueue_dependent(
        self, sig: Signature, depends_on: list[Job | AsyncResult | str], allow_failure: bool
    ) -> Job:
        # The task goes to the dependents queue with what it waits for; a worker releases it
        # (worker/single_active/dependents.py). Sent with a confirm: once this returns, it waits there.
        app = self._app
        ids = [item if isinstance(item, str) else item.id for item in depends_on]
        message, (queue, exchange), serializer = build_message(
            sig, conf=app.conf, settings=app.settings, clock=app.clock, reply_queue=app.reply_queue
        )
        if exchange is not None:
            raise TypeError("depends_on sends to a queue, not to a named exchange")
        headers = {DEPENDS_ON_HEADER: ids, ALLOW_FAILURE_HEADER: allow_failure, TARGET_QUEUE_HEADER: queue}
        message = dataclasses.replace(message, extra_headers={**message.extra_headers, **headers})
        wire = encode_task(message, serializer=serializer or app.settings.serializer)
        holding = dependents_queue(app.settings.namespace)
        from broker_svc.connection.pending import PendingPublish  # pure bookkeeping; no pika

        pending = PendingPublish(
            wire, exchange=DEFAULT_EXCHANGE, routing_key=holding.name, declare=(holding,)
        )
        record = StateRecord.now(
            message.id, JobState.WAITING.value, clock=message.clock or 0, hostname=CLIENT_HOSTNAME,
            name=message.task, queue=queue, info={"depends_on": ids, "allow_failure": allow_failure},
        )  # fmt: skip
        result: AsyncResult = AsyncResult(message.id, store=self._store, publish=pending)
        self._producer().publisher.submit([pending, state_publish(record, self._stream())], wait=True)
        return Job(self, message.id, result=result)

    def cancel(self, task_id: str) -> None:
        """Revoke the task (through the durable revocation log) and record it REVOKED.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        self._app.control.revoke(task_id)
        self._write(task_id, JobState.REVOKED, {"by": "cancel"})

    def delete(self, task_id: str) -> None:
        """Remove a task: a queued one is skipped unrun when a worker reaches it (a revoke: a message
        cannot be taken out of the middle of a queue), and its state recorded DELETED.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        if latest_state(self.history(task_id)) not in FINAL_STATES:
            self._app.control.revoke(task_id)
        self._write(task_id, JobState.DELETED, {"by": "delete"})

    def close(self, timeout: float | None = None) -> None:
        """Stop the background reader, if one runs, waiting at most ``timeout`` (default 3 s) for it."""
        with self._lock:
            feed, self._feed = self._feed, None
        if feed is not None:
            feed.close(timeout=3.0 if timeout is None else timeout)

    # -- inside ------------------------------------------------------------------------------------

    def _write(self, task_id: str, state: JobState, info: dict[str, Any]) -> None:
        self.history(task_id)  # read up to now: our clock then sorts this record after the others
        record = StateRecord.now(
            task_id, state.value, clock=self._app.clock.forward(), hostname=CLIENT_HOSTNAME, info=info
        )
        self._producer().publisher.submit([state_publish(record, self._stream())], wait=True)

    def _stream(self) -> QueueSpec:
        return task_states_stream(self._app.settings.namespace)

    def _task_name(self, f: Callable[..., Any] | str) -> str:
        if isinstance(f, str):
            return f
        name = getattr(f, "name", None)
        if isinstance(name, str) and name:
            return name
        for task in self._app.tasks.values():
            if getattr(type(task), "__wrapped__", None) is f:
                return task.name
        raise TypeError(f"{f!r} is not a task of this app: decorate it with @app.task or pass its name")

    def _ensure_feed(self) -> StateFeed:
        feed = self._feed
        if feed is not None:
            return feed
        from broker_svc.connection.state_feed import StateFeed  # pika: loaded on the first question

        with self._lock:
            if self._feed is None:
                self._feed = StateFeed(self._app.settings, clock=self._app.clock)
            return self._feed


class Job:
    """One job (a task) as RQ shows it: ``id``, ``get_status()``, ``result``, ``cancel()``, ``delete()``.

    Args:
        jobs: the app's jobs.
        job_id: the task id.
        result: the result handle, when this process sent it (its result comes here).
    """

    def __init__(self, jobs: Jobs, job_id: str, *, result: AsyncResult | None = None) -> None:
        self._jobs = jobs
        self.id = job_id
        self._result = result
        self._status: str | None = None

    def __repr__(self) -> str:
        return f"<Job {self.id}>"

    def get_status(self, refresh: bool = True) -> str:
        """The job's latest state from the stream (UNKNOWN if it has none).

        Raises:
            BrokerUnavailable: the stream could not be read.
        """
        if refresh or self._status is None:
            self._status = self._jobs.status(self.id)
        return self._status

    def refresh(self) -> None:
        """Read the status again (``get_status(refresh=False)`` then answers it).

        Raises:
            BrokerUnavailable: the stream could not be read.
        """
        self.get_status(refresh=True)

    @property
    def is_finished(self) -> bool:
        """RQ's ``is_finished``: the task succeeded."""
        return self.get_status() == JobState.SUCCESS

    @property
    def is_failed(self) -> bool:
        """RQ's ``is_failed``: the task failed."""
        return self.get_status() == JobState.FAILURE

    def history(self) -> list[StateRecord]:
        """The job's records on the stream, in order.

        Raises:
            BrokerUnavailable: the stream could not be read.
        """
        return self._jobs.history(self.id)

    @property
    def result(self) -> Any:
        """The return value once it arrived (None before; where the job was enqueued, or anywhere
        with a Redis result backend)."""
        return self._result.result if self._result is not None else None

    def return_value(self, refresh: bool = False) -> Any:
        """RQ 1.12's name for ``result``."""
        del refresh
        return self.result

    def get(self, timeout: float | None = None) -> Any:
        """Wait for the result (where the job was enqueued, or anywhere with a Redis backend).

        Raises:
            RuntimeError: this process did not enqueue it and results go to the sender (rpc://).
            TimeoutError: no result within ``timeout``.
            Exception: the task's own error, if it failed.
        """
        if self._result is None:
            raise RuntimeError("results come to the process that enqueued the job; use get_status() here")
        return self._result.get(timeout=timeout)

    def cancel(self) -> None:
        """Revoke the job and record it REVOKED.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        self._jobs.cancel(self.id)

    def delete(self) -> None:
        """Skip the job if still queued, and record it DELETED.

        Raises:
            BrokerUnavailable: the broker cannot be reached.
        """
        self._jobs.delete(self.id)
