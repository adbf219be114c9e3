"""``ResultWriter``: task states written as Celery's Redis backend writes them, and PUBLISHed."""

from __future__ import annotations

from typing import Any

import redis

from broker_svc.errors import MessageError
from broker_svc.redis_results.backend_conf import RedisBackendConf
from broker_svc.redis_results.connection import WRITE_BUDGET_S, with_retries
from broker_svc.wire import codec
from broker_svc.wire.task.states import State

__all__ = ["ResultWriter"]


class ResultWriter:
    """Writes task states under ``celery-task-meta-<id>`` with their expiry, and PUBLISHes each.

    Args:
        client: a redis-py client (one per process; it pools its connections).
        conf: the app's Redis backend.
    """

    def __init__(self, client: redis.Redis, conf: RedisBackendConf) -> None:
        self.client = client
        self.conf = conf

    def encode(self, value: Any) -> bytes:
        """``value`` in the ``result_serializer`` (Celery stores no content type beside it).

        Raises:
            TypeError, ValueError, OverflowError: the serializer cannot carry it.
        """
        return codec.encode(value, self.conf.serializer)[0]

    def decode(self, payload: bytes) -> Any:
        """A stored value read back.

        Raises:
            MessageError: it does not decode in the ``result_serializer``.
        """
        content_type = codec.content_type_of(self.conf.serializer)[0]
        return codec.decode(payload, content_type, accept=self.conf.accept, max_bytes=self.conf.max_bytes)

    def store(self, meta: dict[str, Any], *, within_s: float = WRITE_BUDGET_S) -> bool:
        """Write ``meta`` (``result_meta``) and PUBLISH it; False if the task already succeeded.

        As Celery's backend: a SUCCESS stored is never overwritten (a copy that ran again, or a
        late STARTED, must not hide it); a FAILURE keeps ``result_failure_expires``.

        Raises:
            ResultBackendUnavailable: Redis did not take it within ``within_s`` of retries.
            TypeError, ValueError, OverflowError: the ``result_serializer`` cannot carry it.
        """
        key = self.conf.keys.task(meta["task_id"])
        payload = self.encode(meta)
        conf = self.conf
        expires_s = conf.failure_expires_s if meta["status"] == State.FAILURE else conf.expires_s

        def write() -> bool:
            current = self.client.get(key)
            if current is not None and _succeeded(
                self, current if isinstance(current, bytes) else current.encode()
            ):
                return False
            with self.client.pipeline() as pipe:  # MULTI/EXEC: the value and its notice together
                if expires_s:
                    pipe.setex(key, expires_s, payload)
                else:
                    pipe.set(key, payload)
                pipe.publish(key, payload)
                pipe.execute()
            return True

        return with_retries(write, what=f"store {meta['status']} of {meta['task_id']}", within_s=within_s)


def _succeeded(writer: ResultWriter, payload: bytes) -> bool:
    try:
        current = writer.decode(payload)
    except MessageError:  # unreadable here (another serializer): overwritten; no reader could use it
        return False
    return isinstance(current, dict) and current.get("status") == State.SUCCESS
