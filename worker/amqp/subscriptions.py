"""Connections of their own for the worker's subscribers to queues and streams every worker declares.

Workers that start together declare the same new quorum queues and streams at once (the
revocation log, the members stream, the chord join and dependents queues, the gate shards), and
RabbitMQ 3.10 answers a consume that races such a queue's start with a 541 (INTERNAL_ERROR) that
closes the whole connection. So each of those subscribers consumes on a connection of its own: a
541 there makes only that subscriber subscribe again (its robust connection comes back), and never
takes the publishing connection (events, the mailbox, replies) or the consuming one with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType

import aio_pika.abc
import structlog

__all__ = ["Subscriptions"]

log = structlog.get_logger(__name__)

Connection = aio_pika.abc.AbstractRobustConnection


class Subscriptions:
    """Opens a connection per subscriber, named by its role, and closes every one at the end.

    Args:
        connect: opens the worker's connection for a role (its name in ``rabbitmqctl
            list_connections`` ends with the role).
    """

    def __init__(self, connect: Callable[[str], Awaitable[Connection]]) -> None:
        self._connect = connect
        self._open: set[Connection] = set()

    async def open(self, role: str) -> Connection:
        """A new connection for ``role``, closed when the ``Subscriptions`` are."""
        connection = await self._connect(role)
        self._open.add(connection)
        return connection

    async def serve(self, role: str, run: Callable[[Connection], Awaitable[None]]) -> None:
        """``run`` on a connection of its own, closed when ``run`` ends or is cancelled."""
        connection = await self.open(role)
        try:
            await run(connection)
        finally:
            await self._close(connection)

    @contextlib.asynccontextmanager
    async def session(self, role: str) -> AsyncIterator[Connection]:
        """A connection of its own for one short read (Mingle's read of the members stream)."""
        connection = await self.open(role)
        try:
            yield connection
        finally:
            await self._close(connection)

    async def __aenter__(self) -> Subscriptions:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for connection in list(self._open):
            await self._close(connection)

    async def _close(self, connection: Connection) -> None:
        self._open.discard(connection)
        try:
            await connection.close()
        except Exception as exc:  # closing one the broker already closed: nothing to undo
            log.debug("subscription_connection_close_failed", error=str(exc))
