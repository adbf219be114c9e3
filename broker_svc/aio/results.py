"""Results for the asyncio client: a future per task id, resolved by the reply-queue consumer.

Nothing polls: ``await result.get()`` waits on a future that the consumer of the client's reply
queue resolves when the task's ready state arrives (Celery's ``rpc://`` format, decoded as the
blocking client decodes it, and raised as ``AsyncResult.get`` raises it). With a Redis result
backend, the Redis reader's thread resolves it too, through the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Final, Generic

import aio_pika.abc
from typing_extensions import TypeVar

from broker_svc.errors import MessageError, ResultTimeout
from broker_svc.logging import get_logger
from broker_svc.results.result import outcome_value
from broker_svc.results.store import ResultSource
from broker_svc.wire import codec
from broker_svc.wire.results.message import Outcome
from broker_svc.wire.results.view import OutcomeView, ResultsView
from broker_svc.wire.task.states import State

__all__ = ["AioGroupResult", "AioResult", "ResultWaiters"]

log = get_logger(__name__)

R = TypeVar("R", default=Any)

# Ready results nobody awaits (yet): a late handle (``aapp.AsyncResult(id)``) still finds the
# last ones; bounded, oldest dropped first.
_STRAY_KEPT: Final = 1000


class ResultWaiters:
    """The futures of the tasks one asyncio client waits for, resolved from its reply queue.

    Args:
        accept: content types the results may come in.
        max_bytes: larger result bodies are refused (and logged).
    """

    def __init__(self, *, accept: frozenset[str], max_bytes: int) -> None:
        self._accept = accept
        self._max_bytes = max_bytes
        self._ready: dict[str, asyncio.Future[Outcome]] = {}
        self._holders: dict[str, int] = {}
        self._latest: dict[str, Outcome] = {}
        self._stray: OrderedDict[str, Outcome] = OrderedDict()
        # The app's other source of states (a Redis result backend), or None; set by the client.
        self.source: Callable[[], ResultSource | None] | None = None

    def __len__(self) -> int:
        return len(self._ready)

    def register(self, task_id: str) -> asyncio.Future[Outcome]:
        """The future of ``task_id``'s ready state; one call per handle that holds it."""
        self._holders[task_id] = self._holders.get(task_id, 0) + 1
        future = self._ready.get(task_id)
        if future is None:
            future = self._ready[task_id] = asyncio.get_running_loop().create_future()
            stray = self._stray.pop(task_id, None)
            if stray is not None:
                self._latest[task_id] = stray
                future.set_result(stray)
            source = self.source() if self.source is not None else None
            if source is not None:
                source.watch(task_id)
        return future

    def release(self, task_id: str) -> None:
        """A handle of ``task_id`` is gone; the last one drops its future."""
        count = self._holders.get(task_id, 0) - 1
        if count > 0:
            self._holders[task_id] = count
            return
        self._holders.pop(task_id, None)
        self._ready.pop(task_id, None)
        source = self.source() if self.source is not None else None
        if source is not None:
            source.unwatch(task_id)
        outcome = self._latest.pop(task_id, None)
        if outcome is not None and outcome.ready:
            self._keep_stray(outcome)  # a later handle (``AsyncResult(id)``) still finds it

    def _keep_stray(self, outcome: Outcome) -> None:
        self._stray[outcome.task_id] = outcome
        if len(self._stray) > _STRAY_KEPT:
            self._stray.popitem(last=False)

    def latest(self, task_id: str) -> Outcome | None:
        """The newest state received for ``task_id``, if any."""
        return self._latest.get(task_id)

    async def on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """Reply-queue consumer: decode one result, resolve its future once it is ready."""
        try:
            body = codec.decode(
                message.body, message.content_type, accept=self._accept, max_bytes=self._max_bytes
            )
            outcome = Outcome.from_wire(body, correlation_id=message.correlation_id)
        except MessageError as exc:
            log.warning("result_refused", error=str(exc), correlation_id=message.correlation_id)
            return
        self.offer(outcome)

    def offer(self, outcome: Outcome) -> None:
        """A state received (from the reply queue or, on the loop, from a ``ResultSource``)."""
        future = self._ready.get(outcome.task_id)
        if future is None:
            if outcome.ready:
                self._keep_stray(outcome)
            return
        latest = self._latest.get(outcome.task_id)
        if latest is not None and latest.ready and not outcome.ready:
            return  # read late from a second source (Redis and the reply queue): it ended already
        self._latest[outcome.task_id] = outcome
        if outcome.ready and not future.done():
            future.set_result(outcome)


class AioResult(OutcomeView, Generic[R]):
    """An awaitable handle on one task's result (``await result.get(timeout=10)``).

    Args:
        task_id: the task id.
        waiters: the client's futures, fed by its reply queue.
    """

    def __init__(self, task_id: str, *, waiters: ResultWaiters) -> None:
        self.id = task_id
        # The step before this one in a chain, or a chord's header (Celery's ``result.parent``).
        self.parent: AioResult[Any] | AioGroupResult | None = None
        self._waiters = waiters
        self._future = waiters.register(task_id)

    def __del__(self) -> None:
        waiters = getattr(self, "_waiters", None)
        if waiters is not None:
            waiters.release(self.id)

    def __repr__(self) -> str:
        return f"<AioResult: {self.id}>"

    def _latest(self) -> Outcome | None:
        return self._waiters.latest(self.id)

    # ``timeout=`` as Celery's get() takes it, so code reads the same in both clients.
    async def get(self, timeout: float | None = None, propagate: bool = True) -> R:  # noqa: ASYNC109
        """Wait for the task's result (pushed to the reply queue) and return its value.

        Args:
            timeout: seconds to wait; None waits forever.
            propagate: raise the task's error if it failed, was revoked or declined (else it is
                returned).

        Raises:
            ResultTimeout: nothing ready within ``timeout``.
            TaskError: the task failed (also an instance of the remote builtin type).
            TaskRevokedError: the task was revoked or expired.
            TaskDeclined: the task was declined for its dedup key (``dedup_key``); never run.
        """
        outcome = await self._outcome(limit_s=timeout)
        value: R = outcome_value(outcome, propagate=propagate)
        return value

    async def _outcome(self, *, limit_s: float | None) -> Outcome:
        # A chain's step never comes if a step before it failed: that failure is the answer, as
        # the blocking get() raises a failed parent's error.
        watched: dict[asyncio.Future[Outcome], AioResult[Any]] = {self._future: self}
        node = self.parent
        while isinstance(node, AioResult):  # a chord's header fails its body by itself
            watched[node._future] = node
            node = node.parent
        deadline = None if limit_s is None else time.monotonic() + limit_s
        while True:
            if self._future.done():
                return self._future.result()
            for future in watched:
                if future.done() and future.result().status != State.SUCCESS:
                    return future.result()
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(f"no result for task {self.id} within {limit_s} s")
            waiting = [f for f in watched if not f.done()]
            # asyncio.wait never cancels the futures: another get() may still be waiting on them.
            await asyncio.wait(waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)


class AioGroupResult(ResultsView):
    """The results of a group (or a chord's header), awaited as one.

    Args:
        id: the group's id.
        results: each member's result, in the group's order.
    """

    def __init__(self, id: str, results: Sequence[AioResult[Any] | AioGroupResult]) -> None:
        self.id = id
        self.results = list(results)

    def __repr__(self) -> str:
        return f"<AioGroupResult: {self.id} [{', '.join(r.id for r in self.results)}]>"

    def _members(self) -> Sequence[Any]:
        return self.results

    async def get(self, timeout: float | None = None, propagate: bool = True) -> list[Any]:  # noqa: ASYNC109
        """Each member's value, in order, within one ``timeout`` for all.

        Raises:
            ResultTimeout: not all finished within ``timeout``.
            TaskError: (``propagate``) the first failed member's error, in the group's order.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        values: list[Any] = []
        for result in self.results:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ResultTimeout(f"the group {self.id} did not finish within {timeout} s")
            values.append(await result.get(timeout=remaining, propagate=propagate))
        return values
