"""Revokes that hold: the revoked set, its state file, the durable revocation log, and terminate.

A revoke reaches a worker three ways, and each one ends in ``Revoker.revoke``: the ``revoke``
control command (broadcast), the revocation log on the broker (read from its start on every
connect, then followed), and Mingle (peers' revoked sets at start-up). The set is saved to a state
file shortly after it changes and when the worker stops, so a restarted worker remembers even
without the broker's log.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Final

import aio_pika
import aio_pika.abc
import structlog

from broker_svc.clock import LamportClock
from broker_svc.errors import MessageError
from broker_svc.topology import revocation_log
from control.protocol.request import CLOCK_HEADER, MARKER_HEADER, ok
from control.protocol.revoke_log import CONTENT_TYPE, RevokeEntry
from worker.remote.revoked_set import RevokedSet

__all__ = ["Revoker", "parse_signal"]

log = structlog.get_logger(__name__)

# Changes are written at most this often (and always at stop): a burst of revokes is one write.
_SAVE_DELAY_S: Final = 0.5
_LOG_PREFETCH: Final = 1000


def parse_signal(value: str | int | None) -> signal.Signals:
    """A signal from Celery's spellings: ``SIGKILL``, ``KILL``, ``9``; default SIGTERM.

    Raises:
        ValueError: not a signal this platform knows.
    """
    if value is None or value == "":
        return signal.SIGTERM
    if isinstance(value, int) and not isinstance(value, bool):
        return signal.Signals(value)
    text = str(value).strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    name = text if text.startswith("SIG") else f"SIG{text}"
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {value!r}") from None


class Revoker:
    """Owns the worker's revoked set.

    Args:
        revoked: the set (shared with the ``revoked`` and ``hello`` commands).
        terminate: signals the child running a task; True if it ran here.
        clock: the process clock (log entries carry one).
        hostname: this node, stamped on the entries it journals.
        state_path: the state file, or None to keep the set in memory only.
        namespace: the control namespace, which names the revocation log.
    """

    def __init__(
        self,
        revoked: RevokedSet,
        *,
        terminate: Callable[[str, int], Awaitable[bool]],
        clock: LamportClock,
        hostname: str,
        state_path: Path | None,
        namespace: str,
    ) -> None:
        self._revoked = revoked
        self._terminate = terminate
        self._clock = clock
        self._hostname = hostname
        self._state_path = state_path
        self._log_spec = revocation_log(namespace)
        self._publish_channel: aio_pika.abc.AbstractChannel | None = None
        self._save_handle: asyncio.TimerHandle | None = None
        self._markers: dict[str, asyncio.Future[None]] = {}
        self.log_available = False
        self.log_entries_read = 0

    @property
    def revoked(self) -> RevokedSet:
        """The revoked set."""
        return self._revoked

    def load(self) -> int:
        """Read the state file (before consuming): how many unexpired ids it held."""
        if self._state_path is None:
            return 0
        loaded = self._revoked.load(self._state_path)
        if loaded:
            log.info("revoked_state_loaded", path=str(self._state_path), ids=loaded)
        return loaded

    def save(self) -> None:
        """Write the state file now (at stop); errors are logged."""
        if self._save_handle is not None:
            self._save_handle.cancel()
            self._save_handle = None
        if self._state_path is None:
            return
        try:
            self._revoked.save(self._state_path)
        except OSError as exc:
            log.error("revoked_state_not_saved", path=str(self._state_path), error=str(exc))

    def _changed(self) -> None:
        if self._state_path is not None and self._save_handle is None:
            self._save_handle = asyncio.get_running_loop().call_later(_SAVE_DELAY_S, self.save)

    def add(self, task_ids: Iterable[str], *, age_s: float = 0.0) -> int:
        """Revoke ids without terminating; ``age_s`` back-dates them (a log entry's age).

        Returns:
            How many ids were not revoked before.
        """
        at = time.monotonic() - max(0.0, age_s)
        new = 0
        for task_id in task_ids:
            if task_id not in self._revoked:
                new += 1
            self._revoked.add(task_id, at=at)
        if new:
            self._changed()
        return new

    def merge_peer(self, data: Any) -> int:
        """Merge a peer's revoked set (Mingle); returns how many ids were new."""
        new = self._revoked.merge_wire(data)
        if new:
            self._changed()
        return new

    async def revoke(
        self, task_ids: list[str], *, terminate: bool, signal_name: str | int | None
    ) -> dict[str, Any]:
        """Revoke ids, and with ``terminate`` signal the children running them. Celery's replies."""
        sig = parse_signal(signal_name) if terminate else None
        self.add(task_ids)
        if sig is None:
            return ok(f"tasks {_set_repr(task_ids)} flagged as revoked")
        terminated = [task_id for task_id in task_ids if await self._terminate(task_id, sig)]
        if terminated:
            log.info("tasks_terminated", task_ids=terminated, signal=sig.name)
            return ok(f"terminate: {', '.join(terminated)}")
        return ok("terminate: tasks unknown")

    # -- the log on the broker ---------------------------------------------------------------------

    async def follow_log(
        self,
        channel: aio_pika.abc.AbstractChannel,
        publish_channel: aio_pika.abc.AbstractChannel,
        *,
        catch_up_s: float = 10.0,
    ) -> None:
        """Declare the revocation log, read it from its start, and keep following it.

        Returns once everything the log held when it was called has been read (or after
        ``catch_up_s``), so tasks consumed afterwards are checked against every earlier revoke.
        A broker without streams (or a refused declare) leaves revokes to broadcasts, Mingle and
        the state file; that is logged, not fatal.
        """
        self._publish_channel = publish_channel
        spec = self._log_spec
        try:
            await channel.set_qos(prefetch_count=_LOG_PREFETCH)
            queue = await channel.declare_queue(spec.name, durable=spec.durable, arguments=spec.arguments)
            await queue.consume(self._on_entry, arguments={"x-stream-offset": "first"})
        except aio_pika.exceptions.AMQPError as exc:
            log.error("revocation_log_unavailable", queue=spec.name, error=str(exc))
            return
        self.log_available = True
        await self.catch_up(timeout_s=catch_up_s)

    async def catch_up(self, *, timeout_s: float) -> bool:
        """Wait until the log has been read up to now: True if it was within ``timeout_s``."""
        channel = self._publish_channel
        if channel is None or not self.log_available:
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
        log.info(
            "revocation_log_read",
            entries=self.log_entries_read,
            revoked=len(self._revoked),
            ms=round((time.monotonic() - started) * 1000, 1),
        )
        return True

    async def journal(self, task_ids: list[str], *, terminate: bool, signal_name: str | None) -> None:
        """Append a broadcast revoke (one that did not come through our client) to the log."""
        channel = self._publish_channel
        if channel is None or not self.log_available:
            return
        try:
            entry = RevokeEntry.new(
                task_ids, terminate=terminate, signal=signal_name or "SIGTERM", hostname=self._hostname
            )
            await channel.default_exchange.publish(
                aio_pika.Message(
                    entry.encode(),
                    content_type=CONTENT_TYPE,
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={CLOCK_HEADER: self._clock.forward()},
                ),
                routing_key=self._log_spec.name,
            )
        except (ValueError, aio_pika.exceptions.AMQPError) as exc:
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
            self.log_entries_read += 1
            age = time.time() - entry.timestamp if entry.timestamp else 0.0
            if age < self._revoked.expires_s:
                self.add(entry.task_ids, age_s=age)
                if entry.terminate:
                    await self.revoke(list(entry.task_ids), terminate=True, signal_name=entry.signal)
        finally:
            await _ack(message)


async def _ack(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    # A stream hands out more entries only as earlier ones are acked.
    try:
        await message.ack()
    except aio_pika.exceptions.AMQPError as exc:
        log.warning("revocation_entry_ack_failed", error=str(exc))


def _set_repr(task_ids: list[str]) -> str:
    return "{" + ", ".join(repr(t) for t in task_ids) + "}"
