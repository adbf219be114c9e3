"""The App: a registry of tasks plus the client that sends them and collects their results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from broker_svc.apps.conf import Config
from broker_svc.apps.control_plane import ControlPlane, load_control
from broker_svc.apps.open_apps import open_apps
from broker_svc.clock import LamportClock
from broker_svc.connection.pending import PendingPublish
from broker_svc.logging import get_logger
from broker_svc.results.backend import ResultBackend
from broker_svc.results.result import AsyncResult
from broker_svc.results.store import ResultStore
from broker_svc.sending.batch import Batch, BatchScope
from broker_svc.sending.capture import current_capture
from broker_svc.sending.dedup_keys import TaskDedup, resolve_dedup
from broker_svc.sending.message import send_signatures
from broker_svc.settings import Settings
from broker_svc.tasks import shared
from broker_svc.tasks.builtins import register_builtins
from broker_svc.tasks.registry import TaskRegistry
from broker_svc.tasks.task import Signature
from broker_svc.tasks.task import Task as TaskBase
from broker_svc.tasks.task_app import set_current_app
from broker_svc.tasks.task_modules import Discovery, import_task_modules
from broker_svc.topology import QueueSpec, new_reply_queue_name, result_queue
from broker_svc.wire import codec
from broker_svc.wire.results.meta import is_redis_url
from broker_svc.wire.task.task_message import WireMessage

if TYPE_CHECKING:
    # Imported when the app first publishes: a worker, its forkserver and its children import the
    # app to run its tasks and need no pika (about 4 MiB each) unless a task sends one.
    from broker_svc.redis_results.reader import RedisResults
    from broker_svc.results.jobs import Job, Jobs
    from broker_svc.sending.producer import Producer
    from broker_svc.spool.stats import SpoolStats

__all__ = ["App"]

log = get_logger(__name__)


class App(TaskRegistry):
    """Tasks and the client to run them, as ``celery.Celery`` is (the registry: ``TaskRegistry``).

    Args:
        main: the app's name; tasks defined in ``__main__`` are named ``<main>.<function>``.
        broker: the broker URL (Celery's name); ``broker_url`` is the same.
        backend: where results go: ``"rpc://"`` (or None: results travel on RabbitMQ) or a
            ``redis://`` URL (Celery's Redis backend, read from any process; ``clockwork-tasks[redis]``).
        include: modules a worker imports at start, for the tasks they define.
        settings: full settings, used as given. Without them, every setting comes from its
            ``CLOCKWORK_<FIELD>`` variable where one is set (``Settings.from_env``), as the worker
            and ``ctl`` read them, so an app and its worker agree on the broker.
        config_source: an object or dotted name for ``config_from_object``.
        set_as_current: make this the app that ``shared_task`` proxies use (Celery's default).
        **conf: more settings by Celery's names (``task_default_queue="jobs"``), as ``app.conf``.

    Raises:
        TypeError: both a broker URL and ``settings`` given.
        ConfigurationError: a ``CLOCKWORK_*`` variable or a setting holds an invalid value.
    """

    def __init__(
        self,
        main: str | None = None,
        *,
        broker: str | None = None,
        broker_url: str | None = None,
        backend: str | None = None,
        include: Iterable[str] | None = None,
        settings: Settings | None = None,
        config_source: Any = None,
        set_as_current: bool = True,
        **conf: Any,
    ) -> None:
        url = broker_url or broker
        if url is not None and settings is not None:
            raise TypeError("pass a broker URL or settings, not both")
        self.main = main
        if settings is None:
            settings = Settings.from_env(broker_url=url) if url else Settings.from_env()
        self.settings = settings
        self.clock = LamportClock()
        self.tasks: dict[str, TaskBase] = {}
        self._task_base: type[TaskBase] | None = None
        self._producer: Producer | None = None
        self._batches = BatchScope()
        self.conf = Config(self._apply_settings)
        if config_source is not None:
            self.conf.from_object(config_source)
        initial: dict[str, Any] = dict(conf)
        if backend is not None:
            initial["result_backend"] = backend
        if include is not None:
            initial["include"] = list(include)
        self.conf.update(initial)
        self._autodiscover: list[Discovery] = []
        self._reply_queue = new_reply_queue_name()
        self._store = ResultStore(
            accept=codec.accept_set(self.settings.accept_content), max_bytes=self.settings.max_body_bytes
        )
        self._control: ControlPlane | None = None
        self._jobs: Jobs | None = None
        self._store.state_lookup = self._stream_state
        self._store.unreachable = self._unreachable
        self._store.source = self._result_source
        self._store.revoke = lambda task_id, **options: self.control.revoke(task_id, **options)
        self._redis_results: RedisResults | None = None
        self._source_lock = threading.Lock()
        # Run by close() with the seconds its timeout has left (None: no timeout was given).
        self._close_hooks: list[Callable[[float | None], None]] = []
        self._lock = threading.Lock()
        open_apps.add(self)
        register_builtins(self)
        if set_as_current:
            set_current_app(self)
        shared.app_created(self)

    # -- configuration ---------------------------------------------------------------------------

    def _apply_settings(self, fields: dict[str, Any]) -> None:
        # app.conf changed a Settings field. A connection made already keeps what it was made with.
        self.settings = self.settings.with_options(**fields)
        if self._producer is not None:
            log.warning("setting_changed_after_connect", settings=sorted(fields), app=self.main)

    def config_from_object(
        self, obj: Any, *, silent: bool = False, force: bool = False, namespace: str | None = None
    ) -> None:
        """Take settings from a module, class or object, or its dotted name, as Celery does.

        ``namespace="CELERY"`` reads only ``CELERY_*`` names (a Django settings module). ``force``
        is accepted: settings apply at once here.

        Raises:
            ImportError: (unless ``silent``) the dotted name does not import.
            ConfigurationError: a value is invalid.
        """
        del force
        try:
            self.conf.from_object(obj, namespace=namespace)
        except ImportError:
            if not silent:
                raise

    def autodiscover_tasks(
        self,
        packages: Iterable[str] | Callable[[], Iterable[str]] | None = None,
        related_name: str = "tasks",
        force: bool = False,
    ) -> None:
        """Find ``<package>.<related_name>`` modules to import for their tasks.

        They are imported when a worker loads the app (``import_task_modules``), or now with
        ``force=True``. A package without such a module is skipped, as in Celery.
        """
        self._autodiscover.append((packages or (), related_name))
        if force:
            self.import_task_modules()

    def import_task_modules(self) -> list[str]:
        """Import the modules ``imports``, ``include`` and ``autodiscover_tasks`` name; their names.

        A worker calls this when it loads the app, so the tasks those modules define are registered.

        Raises:
            ImportError: a module named by ``imports`` or ``include`` does not import.
        """
        return import_task_modules(self.conf, self._autodiscover)

    @property
    def reply_queue(self) -> str:
        """This client's result queue: the ``reply_to`` of every task it sends (Celery's ``thread_oid``)."""
        capture = current_capture()
        return capture.reply_queue if capture is not None else self._reply_queue

    def set_current(self) -> None:
        """Make this the app ``shared_task`` proxies send through (``current_app``)."""
        set_current_app(self)

    @property
    def Task(self) -> type[TaskBase]:  # Celery's name
        """The base class of this app's tasks, bound to it, as Celery's: subclass it for ``base=``
        or for a class-based task (``class T(app.Task)``, then ``app.register_task(T())``)."""
        if self._task_base is None:
            # One class per app, made on first use, so ``T().delay()`` sends through this app.
            self._task_base = type("Task", (TaskBase,), {"app": self, "__module__": TaskBase.__module__})
        return self._task_base

    def __repr__(self) -> str:
        return f"<App {self.main or '__main__'} broker={self.settings.safe_broker_url}>"

    def __enter__(self) -> App:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- sending ---------------------------------------------------------------------------------

    def send_task(
        self,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Send a task by name; the task need not be registered here.

        ``dedup_key`` (a literal key) and ``dedup_timeout`` deduplicate it, as in
        ``Task.apply_async``; a task registered here with its own ``dedup_key`` gets its key
        from these arguments when the send gives none.

        Raises:
            TypeError: an unknown option, or args/kwargs of the wrong type; a dedup key where it
                cannot be honoured (``exchange=``, a chord's header, a callback...).
            ValueError: a dedup key or timeout out of range.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: (``confirm="each"``) the broker did not confirm it.
        """
        [result] = self._send([Signature(name, tuple(args or ()), dict(kwargs or {}), options)])
        return result

    def send_many(self, signatures: Iterable[Signature], *, wait: bool = False) -> list[AsyncResult]:
        """Send many tasks in one hand-over to the connection (the fastest way to enqueue);
        ``wait``: then wait once for all their confirms (with a spool: one write), as ``batch()``.

        Raises:
            TypeError: an unknown option in a signature, or a dedup key that cannot be honoured.
            ValueError: a dedup key or timeout out of range (none of them is sent).
            MessageTooLarge: one encoded task is over the limit (none of them is sent).
            PublishError: (``confirm="each"`` or ``wait``) the broker did not confirm one of them.
            SpoolFull: (spool) none of them was accepted.
        """
        return self._send(list(signatures), wait=wait)

    def publish_confirmed(self, queue: QueueSpec, message: WireMessage) -> None:
        """Publish a message that is not a task (a chord's growth record, say) to ``queue``, declared
        first, and wait for the broker's confirm; never through the spool, so it is in the queue
        before this returns.

        Raises:
            PublishError: the broker did not confirm it.
        """
        pending = PendingPublish(message, exchange="", routing_key=queue.name, declare=(queue,))
        self._ensure_producer().publisher.submit([pending], wait=True)

    def batch(self) -> Batch:
        """``with app.batch() as batch:``: the tasks this thread sends in the block go out together
        at its end, with one wait for all their confirms (or one spool write); see ``Batch``."""
        return Batch(self._batches, lambda pending: self._ensure_producer().submit(pending, wait=True))

    def _send(self, signatures: Sequence[Signature], *, wait: bool = False) -> list[AsyncResult]:
        # Every client send passes here (the asyncio client's too): each call's dedup key is
        # formed now, from the task's own ``dedup_key`` unless the send gave one.
        signatures = [resolve_dedup(sig, self._task_dedup) for sig in signatures]
        capture = current_capture()
        if capture is not None:  # the asyncio client sends them (broker_svc/sending/capture.py)
            return capture.keep(signatures)
        return send_signatures(
            signatures, self._ensure_producer(), batch=self._batches.current, wait=wait, conf=self.conf,
            settings=self.settings, clock=self.clock, reply_queue=self._reply_queue, results=self._store,
        )  # fmt: skip

    def _task_dedup(self, name: str) -> TaskDedup | None:
        # A task's own dedup options, if it is registered here (``send_task`` by name included).
        task = self.tasks.get(name)
        return task._dedup if task is not None else None

    def signature(
        self,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        immutable: bool = False,
        **options: Any,
    ) -> Signature:
        """A signature of the task ``name``, registered here or not (Celery's ``app.signature``)."""
        return Signature(name, args, kwargs, options, immutable=immutable, app=self)

    def AsyncResult(self, task_id: str) -> AsyncResult:
        """A result handle for a task this client sent (results come to this client's queue)."""
        capture = current_capture()
        if capture is not None:
            return capture.result(task_id)
        return AsyncResult(task_id, store=self._store)

    @property
    def backend(self) -> ResultBackend:
        """Celery's result-backend calls on this app's results (``save_group``, ``restore_group``,
        ``delete_group``, ``store_result``): Redis with ``result_backend="redis://..."``; on
        ``rpc://`` they raise ``NotImplementedError`` (``broker_svc/results/backend.py``)."""
        return ResultBackend(self._result_source, self)

    # -- remote control --------------------------------------------------------------------------

    @property
    def control(self) -> ControlPlane:
        """Remote control of the workers, as ``celery.Celery.control``: ``app.control.ping()``,
        ``app.control.inspect().active()``, ``app.control.revoke(task_id)``.

        Its class (``control.api.Control``) lives in a package above this one, so it is typed by
        the ``ControlPlane`` Protocol; it is found through the ``clockwork.control`` entry point
        and shares this app's settings and clock.

        Raises:
            ConfigurationError: the entry point is missing (Clockwork is not installed).
        """
        control = self._control
        if control is not None:
            return control
        with self._lock:
            if self._control is None:
                self._control = load_control(self)
                close = getattr(self._control, "close", None)
                if callable(close):
                    self._close_hooks.append(lambda _left: close())
            return self._control

    # -- jobs and states (docs/guide.md, "Jobs and states") ---------------------------------------

    @property
    def jobs(self) -> Jobs:
        """Task states from the task-state stream and RQ's job calls: ``app.jobs.status(task_id)``."""
        jobs = self._jobs
        if jobs is not None:
            return jobs
        from broker_svc.results.jobs import Jobs  # lazy: a worker's children never need it

        with self._lock:
            if self._jobs is None:
                self._jobs = Jobs(self, store=self._store, producer=self._ensure_producer)
                self._close_hooks.append(self._jobs.close)
            return self._jobs

    def enqueue(self, f: Callable[..., Any] | str, *args: Any, **kwargs: Any) -> Job:
        """RQ's ``Queue.enqueue``: see ``Jobs.enqueue`` (``job_id``, ``ttl``, ``result_ttl``,
        ``at_front``, ``queue``; other keywords go to the task).

        Raises:
            ConfigurationError: ``task_states`` is off.
            TypeError: the arguments do not fit the task.
        """
        return self.jobs.enqueue(f, *args, **kwargs)

    def _result_source(self) -> RedisResults | None:
        # With a Redis result backend, results are read there too, from any process (as Celery's
        # client reads them); made on the first result handle, so ``app.conf`` may set it first.
        source = self._redis_results
        if source is not None or not is_redis_url(self.conf.get("result_backend")):
            return source
        from broker_svc.redis_results.backend_conf import RedisBackendConf  # lazy: needs redis-py
        from broker_svc.redis_results.reader import RedisResults

        with self._source_lock:
            if self._redis_results is None:
                conf = RedisBackendConf.of(self.conf, self.settings)
                assert conf is not None
                self._redis_results = RedisResults(conf, offer=self._store.offer)
                self._close_hooks.append(lambda _left: self._close_redis_results())
            return self._redis_results

    def _close_redis_results(self) -> None:
        source, self._redis_results = self._redis_results, None
        if source is not None:
            source.close()

    def _stream_state(self, task_id: str) -> str | None:
        # ``AsyncResult.state`` of a task with no result here yet: the stream's, when it is kept.
        return self.jobs.status(task_id) if self.settings.task_states else None

    # -- lifecycle -------------------------------------------------------------------------------

    def _ensure_producer(self) -> Producer:
        producer = self._producer
        if producer is not None:
            return producer
        from broker_svc.sending.producer import Producer  # lazy: see the TYPE_CHECKING import

        with self._lock:
            if self._producer is None:
                spec = result_queue(self._reply_queue, expires_s=self.settings.result_expires_s)
                self._producer = Producer(
                    self.settings,
                    clock=self.clock,
                    name=f"clockwork-client-{self.main or 'app'}",
                    consumers=[(spec, self._store.on_delivery)],
                )
            return self._producer

    def connect(self) -> None:
        """Connect (in the background) and open the spool now rather than on the first send; with
        ``spool_dir`` this replays what a crashed predecessor left.

        Raises:
            SpoolError: ``spool_dir`` cannot be used.
        """
        self._ensure_producer()

    def spool_stats(self) -> SpoolStats | None:
        """The spool's depth, age and counts (``spool_dir``), or None while no spool is open."""
        return self._producer.spool_stats() if self._producer is not None else None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every task sent so far is confirmed by the broker.

        Raises:
            PublishError: some were refused, unroutable or unconfirmed (the error says how many);
                with a spool, some are still spooled after ``timeout`` (they stay spooled).
        """
        if self._producer is not None:
            self._producer.flush(timeout)

    def _unreachable(self) -> str | None:
        # Why no result can arrive now: this client's connection to the broker is down.
        producer = self._producer
        return producer.publisher.connection.unavailable() if producer is not None else None

    def close(self, timeout: float | None = None) -> None:
        """Flush, delete this client's result queue, and close the connection (with a spool, what
        the broker has not confirmed within ``timeout`` stays spooled for the next start); returns
        within ``timeout``, the broker up or down.

        Raises:
            PublishError: some tasks were not confirmed; the connection is closed all the same.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        open_apps.discard(self)
        with self._lock:
            producer, self._producer = self._producer, None
            hooks, self._close_hooks = self._close_hooks, []
            self._control = None
            self._jobs = None
        try:
            if producer is not None:
                producer.close(timeout, delete_queue=self._reply_queue)
        finally:
            for hook in hooks:
                try:
                    hook(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except Exception as exc:  # one failing hook must not keep the others from running
                    log.warning("close_hook_failed", hook=repr(hook), error=str(exc))
