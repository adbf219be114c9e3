"""``RedisBackendConf``: what an app's settings say about its Redis result backend, by Celery's names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from broker_svc.errors import ConfigurationError, ContentDisallowed
from broker_svc.settings import Settings
from broker_svc.wire import codec
from broker_svc.wire.results.meta import ResultKeys, is_redis_url

__all__ = ["RedisBackendConf"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisBackendConf:
    """An app's Redis result backend, from ``app.conf`` (Celery's setting names and defaults).

    ``expires_s`` 0 would store results without expiry (``result_expires`` takes no 0 or None
    here, as it also bounds the client's reply queue).
    """

    url: str
    keys: ResultKeys
    serializer: str  # ``result_serializer``: json unless set (the content type is not stored)
    accept: frozenset[str]  # ``result_accept_content``, else ``accept_content``
    expires_s: int  # ``result_expires``
    failure_expires_s: int  # ``result_failure_expires``, else ``result_expires``
    chord_expires_s: int  # ``result_chord_expires``, else ``result_expires``
    chord_join_timeout_s: float  # ``result_chord_join_timeout`` (the dispatch claim's lifetime)
    extended: bool  # ``result_extended``: name, args, kwargs, worker, retries, queue in the meta
    max_bytes: int

    @classmethod
    def of(cls, conf: Mapping[str, Any], settings: Settings) -> RedisBackendConf | None:
        """The app's Redis backend, or None when its ``result_backend`` is not a Redis URL.

        Raises:
            ConfigurationError: a setting of it is invalid.
        """
        url = conf.get("result_backend")
        if not is_redis_url(url):
            return None
        serializer = str(conf.get("result_serializer") or "json")
        accept_names = conf.get("result_accept_content") or settings.accept_content
        try:
            codec.content_type_of(serializer)
            accept = codec.accept_set([accept_names] if isinstance(accept_names, str) else accept_names)
        except ContentDisallowed as exc:
            raise ConfigurationError(f"the Redis result backend's serializers: {exc}") from None
        expires = settings.result_expires_s
        return cls(
            url=str(url),
            keys=ResultKeys.from_transport_options(conf.get("result_backend_transport_options")),
            serializer=serializer,
            accept=accept,
            expires_s=expires,
            failure_expires_s=_seconds(conf.get("result_failure_expires"), expires),
            chord_expires_s=_seconds(conf.get("result_chord_expires"), expires),
            chord_join_timeout_s=float(conf.get("result_chord_join_timeout") or 5.0),
            extended=bool(conf.get("result_extended")),
            max_bytes=settings.max_body_bytes,
        )


def _seconds(value: Any, default: int) -> int:
    if value is None:
        return default
    seconds = getattr(value, "total_seconds", None)
    return int(seconds() if callable(seconds) else value)
