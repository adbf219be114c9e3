"""The App: a registry of tasks plus the client that sends them and collects their results."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from broker_svc import shared, signals
from broker_svc.builtins import register_builtins
from broker_svc.clock import LamportClock
from broker_svc.conf import Config
from broker_svc.connection.pending import PendingPublish
from broker_svc.control_plane import ControlPlane, load_control
from broker_svc.errors import NotRegistered
from broker_svc.library_log import get_logger
from broker_svc.open_apps import open_apps
from broker_svc.request import current_request
from broker_svc.result import AsyncResult, ResultStore
from broker_svc.send_message import Destination, before_publish, build_message
from broker_svc.settings import Settings
from broker_svc.task import Signature, build_task_class
from broker_svc.task import Task as TaskBase
from broker_svc.task_modules import Discovery, import_task_modules
from broker_svc.topology import new_reply_queue_name, result_queue
from broker_svc.wire import codec
from broker_svc.wire.task_message import TaskMessage

if TYPE_CHECKING:
    # Imported when the app first publishes: a worker, its forkserver and its children import the
    # app to run its tasks and need no pika (about 4 MiB each) unless a task sends one.
    from broker_svc.publisher import Publisher

__all__ = ["App"]

log = get_logger(__name__)


class App:
    """Tasks and the client to run them, as ``celery.Celery`` is.

    Args:
        main: the app's name; tasks defined in ``__main__`` are named ``<main>.<function>``.
        broker: the broker URL (Celery's name); ``broker_url`` is the same.
        backend: where results go: only ``"rpc://"`` (or None), as results travel on RabbitMQ.
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
        self._publisher: Publisher | None = None
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
        self._close_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        open_apps.add(self)
        register_builtins(self)
        shared.app_created(self, set_as_current=set_as_current)

    # -- configuration ---------------------------------------------------------------------------

    def _apply_settings(self, fields: dict[str, Any]) -> None:
        # app.conf changed a Settings field. A connection made already keeps what it was made with.
        self.settings = self.settings.with_options(**fields)
        if self._publisher is not None:
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
        return self._reply_queue

    def set_current(self) -> None:
        """Make this the app ``shared_task`` proxies send through (``current_app``)."""
        shared.app_created(self, set_as_current=True)

    @property
    def Task(self) -> type[TaskBase]:  # Celery's name
        """The base class of this app's tasks, to subclass for ``base=`` (``class Base(app.Task)``)."""
        return TaskBase

    def __repr__(self) -> str:
        return f"<App {self.main or '__main__'} broker={self.settings.safe_broker_url}>"

    def __enter__(self) -> App:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- tasks -----------------------------------------------------------------------------------

    @overload
    def task(self, fn: Callable[..., Any], /) -> TaskBase: ...

    @overload
    def task(
        self, fn: None = None, /, *, base: type[TaskBase] = TaskBase, **options: Any
    ) -> Callable[[Callable[..., Any]], TaskBase]: ...

    def task(
        self, fn: Callable[..., Any] | None = None, /, *, base: type[TaskBase] = TaskBase, **options: Any
    ) -> TaskBase | Callable[[Callable[..., Any]], TaskBase]:
        """Register a function as a task: ``@app.task`` or ``@app.task(name=..., bind=True, ...)``.

        Raises:
            TypeError: an unknown option or a bad ``base``.
            ValueError: another task already has this name.
        """

        def register(func: Callable[..., Any]) -> TaskBase:
            return self._register(func, base=base, options=dict(options))

        return register(fn) if fn is not None else register

    def _register(
        self,
        func: Callable[..., Any],
        *,
        base: type[TaskBase],
        options: dict[str, Any],
        shared_name: str | None = None,
    ) -> TaskBase:
        name = options.pop("name", None) or shared_name or self._default_name(func)
        existing = self.tasks.get(name)
        if existing is not None and shared_name is not None:
            if getattr(type(existing), "__wrapped__", None) is func:
                return existing  # the same shared task, offered again
        cls = build_task_class(self, func, name=name, base=base, options=options)
        if existing is not None:
            raise ValueError(f"a task named {name!r} is already registered; pass name= to rename")
        instance = cls()
        self.tasks[name] = instance
        return instance

    def _default_name(self, fn: Callable[..., Any]) -> str:
        module = fn.__module__
        if module == "__main__" and self.main:
            module = self.main
        return f"{module}.{fn.__name__}"

    def get_task(self, name: str) -> TaskBase:
        """The registered task of this name.

        Raises:
            NotRegistered: no such task.
        """
        try:
            return self.tasks[name]
        except KeyError:
            raise NotRegistered(name) from None

    # -- sending ---------------------------------------------------------------------------------

    def send_task(
        self,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Send a task by name; the task need not be registered here.

        Raises:
            TypeError: an unknown option, or args/kwargs of the wrong type.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: (``confirm="each"``) the broker did not confirm it.
        """
        [result] = self._send([Signature(name, tuple(args or ()), dict(kwargs or {}), options)])
        return result

    def send_many(self, signatures: Iterable[Signature]) -> list[AsyncResult]:
        """Send many tasks in one hand-over to the connection (the fastest way to enqueue).

        Raises:
            TypeError: an unknown option in a signature.
            MessageTooLarge: one encoded task is over the limit (none of them is sent).
            PublishError: (``confirm="each"``) the broker did not confirm one of them.
        """
        return self._send(list(signatures))

    def _send(self, signatures: Sequence[Signature]) -> list[AsyncResult]:
        publisher = self._ensure_publisher()
        prepared: list[tuple[PendingPublish, str, bool]] = []
        announce = signals.before_task_publish.has_receivers or signals.after_task_publish.has_receivers
        for sig in signatures:
            message, destination, serializer = self._build_message(sig)
            queue, exchange = destination
            if announce:
                message = before_publish(message, queue, exchange or "")
            pending = publisher.prepare(
                message, queue=queue, queue_type=self.settings.queue_type(queue), serializer=serializer,
                exchange=exchange,
            )  # fmt: skip
            prepared.append((pending, message.id, message.ignore_result))
        # Results register before the publish, so even an instant reply finds its waiter.
        results = [AsyncResult(task_id, store=self._store, publish=p) for p, task_id, _ in prepared]
        publisher.submit([p for p, _, _ in prepared])
        running = current_request()
        if running is not None:  # sent from a task: its children, as Celery's result.children lists
            running.children.extend(task_id for _, task_id, _ in prepared)
        if announce:
            for pending, _, _ in prepared:
                headers = pending.message.headers
                signals.after_task_publish.send(
                    sender=headers.get("task"), headers=headers, body=pending.message.body,
                    exchange=pending.exchange,
                    routing_key=pending.queue,
                )  # fmt: skip
        return results

    def _build_message(self, sig: Signature) -> tuple[TaskMessage, Destination, str | None]:
        return build_message(
            sig, conf=self.conf, settings=self.settings, clock=self.clock, reply_queue=self._reply_queue
        )

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
        return AsyncResult(task_id, store=self._store)

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
                    self._close_hooks.append(close)
            return self._control

    # -- lifecycle -------------------------------------------------------------------------------

    def _ensure_publisher(self) -> Publisher:
        publisher = self._publisher
        if publisher is not None:
            return publisher
        from broker_svc.publisher import Publisher  # lazy: see the TYPE_CHECKING import

        with self._lock:
            if self._publisher is None:
                spec = result_queue(self._reply_queue, expires_s=self.settings.result_expires_s)
                self._publisher = Publisher(
                    self.settings,
                    clock=self.clock,
                    name=f"clockwork-client-{self.main or 'app'}",
                    consumers=[(spec, self._store.on_delivery)],
                )
                self._publisher.connection.start()
            return self._publisher

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every task sent so far is confirmed by the broker.

        Raises:
            PublishError: some were refused, unroutable or unconfirmed (the error says how many).
        """
        if self._publisher is not None:
            self._publisher.flush(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Flush, delete this client's result queue, and close the connection.

        Raises:
            PublishError: some tasks were not confirmed; the connection is closed all the same.
        """
        open_apps.discard(self)
        with self._lock:
            publisher, self._publisher = self._publisher, None
            hooks, self._close_hooks = self._close_hooks, []
            self._control = None
        try:
            if publisher is not None:
                publisher.close(timeout, delete_queue=self._reply_queue)
        finally:
            for hook in hooks:
                try:
                    hook()
                except Exception as exc:  # one failing hook must not keep the others from running
                    log.warning("close_hook_failed", hook=repr(hook), error=str(exc))
