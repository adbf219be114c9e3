"""The durable revocation log on the broker: read from its start on every connect, followed, appended to.

A stream, so a worker that was down when a task was revoked still learns it. Each entry ends in the
worker's ``Revoker``; a marker published to the log and read back tells when everything the log
held has been read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.topology import revocation_log
from control.protocol.request import CLOCK_HEADER, MARKER_HEADER
from control.protocol.revoke_log import CONTENT_TYPE, RevokeEntry
from worker.remote.revoker import Revoker, parse_signal

__all__ = ["RevocationLog"]

log = structlog.get_logger(__name__)

_LOG_PREFETCH: Final = 1000
# A first follow that fails is tried again (a fresh channel each time) with these pauses: workers
# that start together race to declare the new stream, and RabbitMQ may answer a consume that races
# its start with an error, or (its channel crashing on stream_not_found) close the whole connection;
# past them the worker goes on without the log, as on a broker without streams.
_RETRY_PAUSES_S: Final = (0.25, 0.5, 1.0, 2.0, 4.0)


class RevocationLog:
    """Follows the revocation log into a ``Revoker``, and journals broadcast revokes to it.

    Args:
        revoker: where every entry read ends.
        clock: the process clock (entries carry one).
        hostname: this node, stamped on the entries it journals.
        namespace: the control namespace, which names the log.
    """

    def __init__(self, revoker: Revoker, *, clock: LamportClock, hostname: str, namespace: str) -> None:
        self._revoker = revoker
        self._clock = clock
        self._hostname = hostname
        self._log_spec = revocation_log(namespace)
        self._publish_channel: aio_pika.abc.AbstractChannel | None = None
        self._markers: dict[str, asyncio.Future[None]] = {}
        self.available = False
        self.entries_read = 0

    async def follow(
        self,
        channel: Callable[[], Awaitable[aio_pika.abc.AbstractChannel]],
        publish_channel: aio_pika.abc.AbstractChannel,
        *,
        catch_up_s: float = 10.0,
        retry_pauses_s: tuple[float, ...] = _RETRY_PAUSES_S,
    ) -> None:
        """Declare the revocation log, read it from its start, and keep following it.

        Returns once everything the log held when it was called has been read (or after
        ``catch_up_s``), so tasks consumed afterwards are checked against every earlier revoke.
        A failed attempt is tried again on a new ``channel()`` after each of ``retry_pauses_s``.
        A broker without streams (or a declare refused every time) leaves revokes to broadcasts,
        Mingle and the state file; that is logged, not fatal.
        """
        self._publish_channel = publish_channel
        spec = self._log_spec
        for attempt, pause_s in enumerate((*retry_pauses_s, None), start=1):
            try:
                await self._subscribe(await _open(channel))
                break
            except (aio_pika.exceptions.AMQPError, ConnectionError) as exc:
                if pause_s is None:
                    log.error("revocation_log_unavailable", queue=spec.name, error=str(exc), attempts=attempt)
                    return
                log.warning("revocation_log_retrying", queue=spec.name, error=str(exc), retry_in_s=pause_s)
                await asyncio.sleep(pause_s)
        self.available = True
        await self.catch_up(timeout_s=catch_up_s)

    async def _subscribe(self, channel: aio_pika.abc.AbstractChannel) -> None:
        spec = self._log_spec
        try:
            await channel.set_qos(prefetch_count=_LOG_PREFETCH)
            queue = await channel.declare_queue(spec.name, durable=spec.durable, arguments=spec.arguments)
            await queue.consume(self._on_entry, arguments={"x-stream-offset": "first"})
        except aio_pika.exceptions.AMQPError:
            if not channel.is_closed:  # a failed attempt leaves no channel open behind it
                with contextlib.suppress(aio_pika.exceptions.AMQPError, ConnectionError):
                    await channel.close()
            raise

    async def catch_up(self, *, timeout_s: float) -> bool:
        """Wait until the log has been read up to now: True if it was within ``timeout_s``."""
        channel = self._publish_channel
        if channel is None or not self.available:
            return False
        marker = str(uuid.uuid4())
        seen = asyncio.get_running_loop().create_future()
        self._markers[marker] = seen
        started = time.monotonic()
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(b"", headers={MARKER_HEADER: marker}), routing_key=self._log_spec.name
            )
            await asyncio.wait_for(seen, timeout_s)
        except (TimeoutError, aio_pika.exceptions.AMQPError) as exc:
            log.warning("revocation_log_not_caught_up", error=str(exc) or type(exc).__name__)
            return False
        finally:
            self._markers.pop(marker, None)
        log.debug(  # start-up internals: the banner (worker_ready) is the user's line
            "revocation_log_read",
            entries=self.entries_read,
            revoked=len(self._revoker.revoked),
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        return True

    async def journal(self, task_ids: list[str], *, terminate: bool, signal_name: str | None) -> None:
        """Append a broadcast revoke (one that did not come through our client) to the log."""
        try:
            entry = RevokeEntry.new(
                task_ids, terminate=terminate, signal=signal_name or "SIGTERM", hostname=self._hostname
            )
        except ValueError as exc:
            log.warning("revoke_not_journaled", error=str(exc))
            return
        await self._append(entry)

    async def journal_stamps(self, headers: Any, *, terminate: bool, signal_name: str | None) -> None:
        """Append a broadcast revoke by stamps (``celery control revoke_by_stamped_headers``)."""
        try:
            entry = RevokeEntry.stamped(
                headers, terminate=terminate, signal=signal_name or "SIGTERM", hostname=self._hostname
            )
        except ValueError as exc:
            log.warning("revoke_not_journaled", error=str(exc))
            return
        await self._append(entry)

    async def _append(self, entry: RevokeEntry) -> None:
        channel = self._publish_channel
        if channel is None or not self.available:
            return
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    entry.encode(),
                    content_type=CONTENT_TYPE,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={CLOCK_HEADER: self._clock.forward()},
                ),
                routing_key=self._log_spec.name,
            )
        except aio_pika.exceptions.AMQPError as exc:
            log.warning("revoke_not_journaled", error=str(exc))

    async def _on_entry(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        marker = (message.headers or {}).get(MARKER_HEADER)
        if marker is not None:
            seen = self._markers.get(str(marker))
            if seen is not None and not seen.done():
                seen.set_result(None)
            await _ack(message)
            return
        try:
            self._clock.adjust((message.headers or {}).get(CLOCK_HEADER))
            entry = RevokeEntry.decode(message.body)
        except MessageError as exc:
            log.warning("revocation_entry_refused", error=str(exc), size=len(message.body))
        else:
            self.entries_read += 1
            age = time.time() - entry.timestamp if entry.timestamp else 0.0
            if age < self._revoker.revoked.expires_s:
                self._revoker.add(entry.task_ids, age_s=age)
                if entry.terminate and entry.task_ids:
                    await self._revoker.revoke(list(entry.task_ids), terminate=True, signal_name=entry.signal)
                if entry.stamps:
                    await self._stamps_read(entry)
        finally:
            await _ack(message)

    async def _stamps_read(self, entry: RevokeEntry) -> None:
        # Entries as old as a revoked id may be (the log keeps no older ones); a running worker
        # keeps them for its life, as Celery's keeps its revoked stamps.
        assert entry.stamps is not None
        self._revoker.add_stamps(entry.stamps)
        if entry.terminate:
            try:
                sig = parse_signal(entry.signal)
            except ValueError:
                sig = parse_signal(None)
            await self._revoker.terminate_stamped(entry.stamps, sig)


async def _ack(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    # A stream hands out more entries only as earlier ones are acked.
    try:
        await message.ack()
    except aio_pika.exceptions.AMQPError as exc:
        log.warning("revocation_entry_ack_failed", error=str(exc))


async def _open(
    channel: Callable[[], Awaitable[aio_pika.abc.AbstractChannel]],
) -> aio_pika.abc.AbstractChannel:
    # A channel asked of a connection the broker closed (its INTERNAL_ERROR when a consume races
    # the new stream's start) fails with aiormq's RuntimeError: a lost connection, which the robust
    # connection restores, so the attempt is retried like a refused one.
    try:
        return await channel()
    except RuntimeError as exc:
        raise ConnectionError(f"no channel: {exc}") from exc
