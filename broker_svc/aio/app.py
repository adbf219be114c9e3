"""``AsyncApp``: an ``App``'s tasks sent from asyncio, their results awaited as they are pushed.

    async with AsyncApp(app) as aapp:
        result = await aapp.delay(add, 2, 3)     # returns once the broker confirmed the task
        assert await result.get(timeout=10) == 5

An ``AsyncApp`` is made from an existing ``App`` and shares its task registry, settings, routes,
serializer and clock; it has its own connection (aio-pika) and reply queue, bound to the event
loop it was opened on. Every send goes through the blocking code that builds messages
(``Task.apply_async``, the canvas, ``build_message``, ``prepare_publish``) with the send kept
instead of published (``broker_svc/sending/capture.py``), so both clients send the same tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

from typing_extensions import ParamSpec, TypeVar

from broker_svc import signals
from broker_svc.aio.connection import AioConnection
from broker_svc.aio.results import AioGroupResult, AioResult, ResultWaiters
from broker_svc.canvas.signature import Signature
from broker_svc.connection.pending import PendingPublish, prepare_publish
from broker_svc.errors import BrokerUnavailable, ConfigurationError
from broker_svc.results.result import AsyncResult, ResultSet
from broker_svc.sending.capture import capturing
from broker_svc.sending.message import after_publish, before_publish, build_message
from broker_svc.sending.park_records import park_records
from broker_svc.tasks.shared import SharedTask
from broker_svc.tasks.task import Task
from broker_svc.topology import new_reply_queue_name, result_queue
from broker_svc.wire import codec
from broker_svc.wire.results.meta import is_redis_url
from broker_svc.wire.task.task_message import TaskMessage

if TYPE_CHECKING:
    from broker_svc.app import App
    from broker_svc.redis_results.reader import RedisResults
    from broker_svc.wire.results.message import Outcome

__all__ = ["AsyncApp"]

P = ParamSpec("P")
R = TypeVar("R")

AnyResult = AioResult[Any] | AioGroupResult


class AsyncApp:
    """The asyncio client of an ``App``: ``await aapp.delay(task, ...)``, canvases, pushed results.

    Use it as ``async with AsyncApp(app) as aapp:`` (or ``await aapp.connect()`` and
    ``await aapp.close()``), on one event loop. Many coroutines may send at once: they share
    one channel and each awaits its own publisher confirm.

    Args:
        app: the app whose tasks, settings, routes and serializer are used.
        name: the connection name the broker shows (default ``clockwork-aio-<app main>``).

    Raises:
        ConfigurationError: the app runs tasks eagerly (``task_always_eager``): there is no
            asyncio form of that.
    """

    def __init__(self, app: App, *, name: str | None = None) -> None:
        if app.conf.get("task_always_eager"):
            raise ConfigurationError(
                "AsyncApp sends tasks; task_always_eager apps run them with task.apply()"
            )
        self.app = app
        self._name = name or f"clockwork-aio-{app.main or 'app'}"
        self._reply_queue = new_reply_queue_name()
        settings = app.settings
        self._waiters = ResultWaiters(
            accept=codec.accept_set(settings.accept_content), max_bytes=settings.max_body_bytes
        )
        self._waiters.source = self._result_source
        self._redis_results: RedisResults | None = None
        self._connection: AioConnection | None = None
        self._lock: asyncio.Lock | None = None  # made on the loop of the first call
        self._closed = False

    @property
    def reply_queue(self) -> str:
        """This client's result queue: the ``reply_to`` of every task it sends."""
        return self._reply_queue

    def __repr__(self) -> str:
        return f"<AsyncApp of {self.app!r}>"

    async def __aenter__(self) -> AsyncApp:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- connection ------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect and consume the reply queue now, rather than on the first send.

        Raises:
            BrokerUnavailable: the broker could not be reached within ``reconnect_window_s``,
                or the client is closed.
        """
        await self._ensure_connection()

    async def _ensure_connection(self) -> AioConnection:
        connection = self._connection
        if connection is not None:
            return connection
        if self._closed:
            raise BrokerUnavailable("this AsyncApp is closed")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._connection is None:
                spec = result_queue(self._reply_queue, expires_s=self.app.settings.result_expires_s)
                connection = AioConnection(
                    self.app.settings, name=self._name, reply_queue=spec, on_reply=self._waiters.on_message
                )
                await connection.open()
                self._connection = connection
            return self._connection

    async def close(self) -> None:
        """Delete this client's reply queue and close the connection. Sends already awaited
        are confirmed; results not received yet are lost (their handles time out)."""
        self._closed = True
        connection, self._connection = self._connection, None
        source, self._redis_results = self._redis_results, None
        if connection is not None:
            await connection.close()
        if source is not None:
            await asyncio.to_thread(source.close)  # joins its thread

    def _result_source(self) -> RedisResults | None:
        # With a Redis result backend, results are read there too, from any process; its reader
        # thread hands each state to this loop. Made on the first handle, on the client's loop.
        source = self._redis_results
        if source is not None or not is_redis_url(self.app.conf.get("result_backend")):
            return source
        from broker_svc.redis_results.backend_conf import RedisBackendConf  # lazy: needs redis-py
        from broker_svc.redis_results.reader import RedisResults

        conf = RedisBackendConf.of(self.app.conf, self.app.settings)
        assert conf is not None
        loop, offer = asyncio.get_running_loop(), self._waiters.offer

        def to_loop(outcome: Outcome) -> None:  # from the reader's thread
            if not loop.is_closed():  # a client left unclosed when its loop ended: nobody waits
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    loop.call_soon_threadsafe(offer, outcome)

        # No read in the caller's thread: it is the event loop's; the reader reads once subscribed.
        self._redis_results = RedisResults(conf, offer=to_loop, read_on_watch=False)
        return self._redis_results

    # -- sending ---------------------------------------------------------------------------------

    async def delay(
        self, task: Task[P, R] | SharedTask[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> AioResult[R]:
        """Send ``task`` with these arguments (``task.delay`` from asyncio); its result handle.

        Returns once the broker confirmed the task.

        Raises:
            TypeError: the arguments do not fit the task (``typing``), or an unknown option.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: the broker refused it or did not confirm it (``Unroutable``, ``PublishNacked``).
            BrokerUnavailable: the broker was unreachable for ``reconnect_window_s``.
        """
        return await self.apply_async(task, args, kwargs)

    @overload
    async def apply_async(
        self,
        task: Task[P, R] | SharedTask[P, R],
        /,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AioResult[R]: ...

    @overload
    async def apply_async(
        self,
        task: Signature,
        /,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AnyResult: ...

    async def apply_async(
        self,
        task: Task[Any, Any] | SharedTask[Any, Any] | Signature,
        /,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AnyResult:
        """Send a task, a signature or a canvas (chain, group, chord) with send options, as its
        blocking ``apply_async`` sends it; the result handle(s) it returns there, awaitable.

        A chain's and a chord's result is the last step's (``.parent``: the one before); a
        group's is an ``AioGroupResult``. Returns once the broker confirmed every task sent.

        Raises:
            TypeError: bad arguments (``typing``) or an unknown send option.
            ValueError: a canvas the blocking client refuses too (an empty chain, ...).
            MessageTooLarge: an encoded task is over ``max_body_bytes`` (none is sent).
            PublishError: the broker refused or did not confirm a task.
            BrokerUnavailable: the broker was unreachable for ``reconnect_window_s``.
        """
        return await self._send(lambda: task.apply_async(args, kwargs, **options))

    async def send_task(
        self,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> AioResult[Any]:
        """Send a task by name; the task need not be registered here (``App.send_task``).

        Raises:
            TypeError: an unknown option, or args/kwargs of the wrong type.
            MessageTooLarge: the encoded task is over ``max_body_bytes``.
            PublishError: the broker refused it or did not confirm it.
            BrokerUnavailable: the broker was unreachable for ``reconnect_window_s``.
        """
        result = await self._send(lambda: self.app.send_task(name, args, kwargs, **options))
        assert isinstance(result, AioResult)
        return result

    def AsyncResult(self, task_id: str) -> AioResult[Any]:  # Celery's name
        """A handle for a task this client sent (its result comes to this client's queue).

        Must be called on the client's event loop.
        """
        return AioResult(task_id, waiters=self._waiters)

    async def _send(self, send: Callable[[], Any]) -> AnyResult:
        connection = await self._ensure_connection()
        # The blocking code builds every message; the capture keeps them (no await in between).
        with capturing(self._reply_queue) as capture:
            returned = send()
        result = self._convert(returned, {})  # futures exist before anything is sent
        app = self.app
        prepared: list[PendingPublish] = []
        messages: list[TaskMessage] = []
        announce = signals.before_task_publish.has_receivers or signals.after_task_publish.has_receivers
        for sig in capture.kept:
            message, (queue, exchange), serializer = build_message(
                sig, conf=app.conf, settings=app.settings, clock=app.clock, reply_queue=self._reply_queue
            )
            if announce:
                message = before_publish(message, queue, exchange or "")
            prepared.append(
                prepare_publish(
                    message,
                    settings=app.settings,
                    clock=app.clock,
                    queue=queue,
                    queue_type=app.settings.queue_type(queue),
                    serializer=serializer,
                    exchange=exchange,
                )  # fmt: skip
            )
            messages.append(message)
        # inspect scheduled: what goes straight to a delay queue is recorded beside it, never
        # waited on past its task's own confirm (broker_svc/sending/park_records.py).
        records = park_records(
            list(zip(prepared, messages, strict=True)), namespace=app.settings.namespace, now=time.time()
        )
        if len(prepared) == 1 and not records:
            await connection.publish(prepared[0])
        else:
            outcomes = await asyncio.gather(
                *(connection.publish(p) for p in prepared),
                *(connection.publish_side(r) for r in records),
                return_exceptions=True,
            )
            error = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if error is not None:
                raise error
        if announce:
            after_publish(prepared)
        return result

    def _convert(self, returned: Any, seen: dict[str, AnyResult]) -> AnyResult:
        # The blocking canvas's placeholder results, as awaitable ones (same ids, same parents).
        if isinstance(returned, AsyncResult):
            known = seen.get(returned.id)
            if known is not None:
                return known
            result: AioResult[Any] = AioResult(returned.id, waiters=self._waiters)
            seen[returned.id] = result
            if returned.parent is not None:
                result.parent = self._convert(returned.parent, seen)
            return result
        if isinstance(returned, ResultSet):
            members = [self._convert(member, seen) for member in returned.results]
            return AioGroupResult(getattr(returned, "id", ""), members)
        raise TypeError(f"AsyncApp cannot await a {type(returned).__name__} (task_always_eager?)")
