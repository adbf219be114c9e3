"""``RedisResults``: a client's results read from Celery's Redis backend, from any process.

As Celery's ``ResultConsumer``: the client subscribes to each awaited task's key (its PUBLISH
channel) and reads the key once subscribed, so a state written before the subscription and one
published after it are both seen. One background thread owns the pubsub connection (redis-py's
is not thread-safe); callers hand it their subscriptions.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

import redis

from broker_svc.errors import MessageError
from broker_svc.logging import get_logger
from broker_svc.redis_results.backend_conf import RedisBackendConf
from broker_svc.redis_results.connection import REDIS_ERRORS, open_client, with_retries
from broker_svc.redis_results.writer import ResultWriter
from broker_svc.wire.results.message import Outcome

__all__ = ["RedisResults"]

log = get_logger(__name__)

# How long the thread waits for a message before it looks at new subscriptions.
_POLL_S: Final = 0.05
_RECONNECT_S: Final = (0.2, 0.5, 1.0, 2.0)


class RedisResults:
    """The states of the tasks a client waits for, read from Redis and handed to ``offer``.

    Args:
        conf: the app's Redis backend.
        offer: called with each state read (from this thread or the caller's).
        read_on_watch: ``watch`` reads the stored state in the caller's thread too (so ``state``
            right after a handle is made is Redis's); off for an event loop's thread.
    """

    def __init__(
        self, conf: RedisBackendConf, *, offer: Callable[[Outcome], None], read_on_watch: bool = True
    ) -> None:
        self._read_on_watch = read_on_watch
        self._client = open_client(conf.url)
        self._reader = ResultWriter(self._client, conf)  # its decode and keys
        self._keys = conf.keys
        self._offer = offer
        self._lock = threading.Lock()
        self._watched: set[str] = set()
        self._to_subscribe: set[str] = set()
        self._to_unsubscribe: set[str] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, task_id: str) -> None:
        """Follow ``task_id``'s state: read it now, and every state published from now on."""
        key = self._keys.task(task_id)
        with self._lock:
            self._watched.add(key)
            self._to_unsubscribe.discard(key)
            self._to_subscribe.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="clockwork-redis-results", daemon=True)
                self._thread.start()
        if not self._read_on_watch:
            return
        try:
            self._read([key])  # ``state`` right after the handle is made is Redis's, as Celery's
        except REDIS_ERRORS as exc:
            log.warning("result_backend_read_failed", task_key=key, error=str(exc))

    def unwatch(self, task_id: str) -> None:
        """Stop following ``task_id`` (no handle holds it any more)."""
        key = self._keys.task(task_id)
        with self._lock:
            self._watched.discard(key)
            self._to_subscribe.discard(key)
            self._to_unsubscribe.add(key)

    def forget(self, task_id: str) -> None:
        """Delete ``task_id``'s stored state (Celery's ``AsyncResult.forget``).

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
        """
        key = self._keys.task(task_id)
        with_retries(lambda: self._client.delete(key), what=f"forget {task_id}")

    def save_group(self, group_id: str, value: Any) -> None:
        """Store a group's results under ``celery-taskset-meta-<id>`` (Celery's ``save_group``:
        ``{"result": <GroupResult.as_tuple()>}`` with ``result_expires``).

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
        """
        key, payload = self._keys.group(group_id), self._reader.encode({"result": value})
        expires_s = self._reader.conf.expires_s

        def write() -> None:
            if expires_s:
                self._client.setex(key, expires_s, payload)
            else:
                self._client.set(key, payload)

        with_retries(write, what=f"save group {group_id}")

    def restore_group(self, group_id: str) -> Any | None:
        """The tuple a ``save_group`` stored for ``group_id``, or None.

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
            MessageError: what is stored does not decode.
        """
        key = self._keys.group(group_id)
        payload = with_retries(lambda: self._client.get(key), what=f"restore group {group_id}")
        if payload is None:
            return None
        meta = self._reader.decode(payload if isinstance(payload, bytes) else str(payload).encode())
        return meta.get("result") if isinstance(meta, dict) else None

    def delete_group(self, group_id: str) -> None:
        """Delete a saved group (Celery's ``delete_group``).

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
        """
        key = self._keys.group(group_id)
        with_retries(lambda: self._client.delete(key), what=f"delete group {group_id}")

    def add_to_chord(self, group_id: str) -> None:
        """Count one more task in a Redis-counted chord (Celery's ``add_to_chord``: ``<group>.t`` + 1).

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
        """
        key = self._keys.group(group_id, ".t")
        with_retries(lambda: self._client.incr(key), what=f"add to chord {group_id}")

    def store(self, meta: dict[str, Any]) -> None:
        """Store and publish a task's state from this process (``app.backend.store_result``).

        Raises:
            ResultBackendUnavailable: Redis could not be reached.
        """
        self._reader.store(meta)

    def close(self) -> None:
        """Stop the thread and close the connections."""
        self._stopping.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=2.0)
        self._client.close()

    def _read(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        for key, payload in zip(keys, self._client.mget(keys), strict=True):
            if payload is not None:
                self._deliver(key, payload)

    def _deliver(self, key: str, payload: Any) -> None:
        try:
            outcome = Outcome.from_wire(self._reader.decode(bytes(payload)))
        except MessageError as exc:
            log.warning("result_refused", task_key=key, error=str(exc))
            return
        self._offer(outcome)

    def _run(self) -> None:
        attempt = 0
        while not self._stopping.is_set():
            pubsub = self._client.pubsub()
            try:
                with self._lock:  # a new connection: every key again, read after subscribing
                    self._to_subscribe |= self._watched
                    self._to_unsubscribe.clear()
                self._serve(pubsub)
                return
            except Exception as exc:  # Redis's errors, and any other: the waits depend on this thread
                pause_s = _RECONNECT_S[min(attempt, len(_RECONNECT_S) - 1)]
                attempt += 1
                if isinstance(exc, REDIS_ERRORS):
                    log.warning("result_backend_subscription_lost", error=str(exc), retry_in_s=pause_s)
                else:
                    log.exception("result_backend_reader_failed", retry_in_s=pause_s)
                self._stopping.wait(pause_s)
            finally:
                pubsub.close()

    def _serve(self, pubsub: redis.client.PubSub) -> None:
        while not self._stopping.is_set():
            with self._lock:
                subscribe, self._to_subscribe = self._to_subscribe, set()
                unsubscribe, self._to_unsubscribe = self._to_unsubscribe, set()
            if unsubscribe and pubsub.subscribed:
                pubsub.unsubscribe(*unsubscribe)  # type: ignore[no-untyped-call]  # untyped in redis-py
            if subscribe:
                pubsub.subscribe(*subscribe)
            if not pubsub.subscribed:
                self._stopping.wait(_POLL_S)
                continue
            message = pubsub.get_message(timeout=_POLL_S)
            if message is None:
                continue
            channel = message["channel"]
            key = channel.decode() if isinstance(channel, bytes) else str(channel)
            if message.get("type") == "message":
                self._deliver(key, message["data"])
            elif message.get("type") == "subscribe":
                # Subscribed now: what is published from here on arrives; read what came before.
                self._read([key])
