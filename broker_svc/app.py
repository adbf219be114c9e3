"""The App: a registry of tasks plus the client that sends them and collects their results."""

from __future__ import annotations

import atexit
import datetime as dt
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import structlog

from broker_svc.clock import LamportClock
from broker_svc.connection.pending import PendingPublish
from broker_svc.control_plane import ControlPlane, load_control
from broker_svc.errors import BrokerSvcError, NotRegistered
from broker_svc.result import AsyncResult, ResultStore
from broker_svc.settings import Settings
from broker_svc.task import (
    SEND_OPTIONS,
    Signature,
    Task,
    build_task_class,
    countdown_to_eta,
    current_request,
)
from broker_svc.topology import new_reply_queue_name, result_queue
from broker_svc.wire import codec
from broker_svc.wire.task_message import TaskMessage

if TYPE_CHECKING:
    # Imported when the app first publishes: a worker, its forkserver and its children import the
    # app to run its tasks and need no pika (about 4 MiB each) unless a task sends one.
    from broker_svc.publisher import Publisher

__all__ = ["App"]

log = structlog.get_logger(__name__)


class App:
    """Tasks and the client to run them, as ``celery.Celery`` is.

    Args:
        main: the app's name; tasks defined in ``__main__`` are named ``<main>.<function>``.
        broker_url: the broker; without it, ``$CLOCKWORK_BROKER_URL``, else the local default.
        settings: full settings, used as given. Without them, every setting comes from its
            ``CLOCKWORK_<FIELD>`` variable where one is set (``Settings.from_env``), as the worker
            and ``ctl`` read them, so an app and its worker agree on the broker.

    Raises:
        TypeError: both ``broker_url`` and ``settings`` given.
        ConfigurationError: a ``CLOCKWORK_*`` variable holds an invalid value.
    """

    def __init__(
        self, main: str | None = None, *, broker_url: str | None = None, settings: Settings | None = None
    ) -> None:
        if broker_url is not None and settings is not None:
            raise TypeError("pass broker_url or settings, not both")
        self.main = main
        if settings is None:
            settings = Settings.from_env(broker_url=broker_url) if broker_url else Settings.from_env()
        self.settings = settings
        self.clock = LamportClock()
        self.tasks: dict[str, Task] = {}
        self._reply_queue = new_reply_queue_name()
        self._store = ResultStore(
            accept=codec.accept_set(self.settings.accept_content), max_bytes=self.settings.max_body_bytes
        )
        self._publisher: Publisher | None = None
        self._control: ControlPlane | None = None
        self._close_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        _open_apps.add(self)

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
    def task(self, fn: Callable[..., Any], /) -> Task: ...

    @overload
    def task(
        self, fn: None = None, /, *, base: type[Task] = Task, **options: Any
    ) -> Callable[[Callable[..., Any]], Task]: ...

    def task(
        self, fn: Callable[..., Any] | None = None, /, *, base: type[Task] = Task, **options: Any
    ) -> Task | Callable[[Callable[..., Any]], Task]:
        """Register a function as a task: ``@app.task`` or ``@app.task(name=..., bind=True, ...)``.

        Raises:
            TypeError: an unknown option or a bad ``base``.
            ValueError: another task already has this name.
        """

        def register(func: Callable[..., Any]) -> Task:
            name = options.pop("name", None) or self._default_name(func)
            cls = build_task_class(self, func, name=name, base=base, options=options)
            if name in self.tasks:
                raise ValueError(f"a task named {name!r} is already registered; pass name= to rename")
            instance = cls()
            self.tasks[name] = instance
            return instance

        return register(fn) if fn is not None else register

    def _default_name(self, fn: Callable[..., Any]) -> str:
        module = fn.__module__
        if module == "__main__" and self.main:
            module = self.main
        return f"{module}.{fn.__name__}"

    def get_task(self, name: str) -> Task:
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
        for sig in signatures:
            message, queue, serializer = self._build_message(sig)
            pending = publisher.prepare(
                message, queue=queue, queue_type=self.settings.queue_type(queue), serializer=serializer
            )
            prepared.append((pending, message.id, message.ignore_result))
        # Results register before the publish, so even an instant reply finds its waiter.
        results = [AsyncResult(task_id, store=self._store, publish=p) for p, task_id, _ in prepared]
        publisher.submit([p for p, _, _ in prepared])
        return results

    def _build_message(self, sig: Signature) -> tuple[TaskMessage, str, str | None]:
        options = sig.options
        unknown = set(options) - SEND_OPTIONS
        if unknown:
            raise TypeError(f"unknown send option(s) {sorted(unknown)}; known: {sorted(SEND_OPTIONS)}")
        if not isinstance(sig.kwargs, Mapping):
            raise TypeError("kwargs must be a mapping")
        eta = options.get("eta")
        if options.get("countdown") is not None:
            eta = countdown_to_eta(float(options["countdown"]))
        expires = options.get("expires")
        if isinstance(expires, int | float):
            expires = countdown_to_eta(float(expires))
        for label, value in (("eta", eta), ("expires", expires)):
            if value is not None and not isinstance(value, dt.datetime):
                raise TypeError(f"{label} must be a datetime (or a number of seconds for expires)")
        eta = _aware(eta)
        expires = _aware(expires)
        task_id = options.get("task_id") or TaskMessage.new_id()
        ignore_result = bool(options.get("ignore_result", False))
        # A task sent from inside a running task is its child: parent_id/root_id link the tree.
        parent = current_request()
        if parent is not None and not parent.called_directly:
            options = {"parent_id": parent.id, "root_id": parent.root_id or parent.id, **options}
        message = TaskMessage(
            id=task_id,
            task=sig.task,
            args=list(sig.args),
            kwargs=dict(sig.kwargs),
            root_id=options.get("root_id"),
            parent_id=options.get("parent_id"),
            retries=int(options.get("retries", 0)),
            eta=eta,
            expires=expires,
            timelimit=(options.get("time_limit"), options.get("soft_time_limit")),
            ignore_result=ignore_result,
            shadow=options.get("shadow"),
            clock=self.clock.forward(),
            reply_to=options.get("reply_to") or self._reply_queue,
            correlation_id=task_id,
            priority=options.get("priority"),
            extra_headers=dict(options.get("headers") or {}),
        )
        return message, options.get("queue") or self.settings.default_queue, options.get("serializer")

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
        _open_apps.discard(self)
        with self._lock:
            publisher, self._publisher = self._publisher, None
            hooks, self._close_hooks = self._close_hooks, []
            self._control = None
        try:
            if publisher is not None:
                try:
                    publisher.flush(self.settings.confirm_timeout_s if timeout is None else timeout)
                finally:
                    try:
                        publisher.connection.delete_queue(self._reply_queue, timeout=2.0)
                    except BrokerSvcError:
                        pass  # x-expires removes it later
                    publisher.connection.close()
        finally:
            for hook in hooks:
                try:
                    hook()
                except Exception as exc:  # one failing hook must not keep the others from running
                    log.warning("close_hook_failed", hook=repr(hook), error=str(exc))


def _aware(value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)
    return value


_open_apps: weakref.WeakSet[App] = weakref.WeakSet()


@atexit.register
def _close_open_apps() -> None:
    # Interpreter exit waits for outstanding confirms and says what was not confirmed.
    for app in list(_open_apps):
        try:
            app.close()
        except BrokerSvcError as exc:
            log.error("unconfirmed_at_exit", app=app.main, error=str(exc))
