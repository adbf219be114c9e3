"""Settings: one frozen dataclass, built from a URL or the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from broker_svc.errors import ConfigurationError

__all__ = ["DEFAULT_BROKER_URL", "ConfirmMode", "Settings", "redact_url"]

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"

ConfirmMode = Literal["pipelined", "each"]

_SERIALIZERS = ("msgpack", "json")


def redact_url(url: str) -> str:
    """Return ``url`` with its password replaced by ``***`` (for logs, reprs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a client or worker needs to talk to the broker.

    The AMQP URL is the single connection source. Units are in the names.

    Attributes:
        broker_url: ``amqp://user:password@host:port/vhost`` (``//`` is the default vhost).
        default_queue: where tasks go when no queue is named (Celery's ``celery``).
        serializer: how our client encodes task bodies: ``msgpack`` (default) or ``json``.
        accept_content: content types a receiver decodes; never pickle or yaml.
        max_body_bytes: bodies larger than this are refused on publish and dead-lettered on receive.
        confirm: ``pipelined`` (a call returns once the message is handed to the connection; confirms
            are tracked in the background) or ``each`` (each call waits for its own confirm).
        publish_attempts: how often one message is sent before its publish is reported failed.
        max_unconfirmed: messages a client may have handed over and not yet confirmed; a producer
            that gets this far ahead of the broker waits (backpressure, bounded memory).
        confirm_timeout_s: how long a publish may stay unconfirmed before it counts as failed.
        connect_timeout_s: timeout of one connection attempt.
        reconnect_window_s: how long a client keeps reconnecting before pending publishes fail.
        heartbeat_s: AMQP heartbeat interval.
        result_expires_s: idle lifetime of a client's result queue (``x-expires``).
        result_persistent: publish results with delivery mode 2.
    """

    broker_url: str = field(default=DEFAULT_BROKER_URL, repr=False)
    default_queue: str = "celery"
    serializer: str = "msgpack"
    accept_content: tuple[str, ...] = ("msgpack", "json")
    max_body_bytes: int = 10 * 1024 * 1024
    confirm: ConfirmMode = "pipelined"
    publish_attempts: int = 3
    max_unconfirmed: int = 50_000
    confirm_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    reconnect_window_s: float = 30.0
    heartbeat_s: int = 30
    result_expires_s: int = 86_400
    result_persistent: bool = False

    def __post_init__(self) -> None:
        scheme = urlsplit(self.broker_url).scheme
        if scheme not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"broker URL must start with amqp:// or amqps://, got {redact_url(self.broker_url)!r}"
            )
        if self.serializer not in _SERIALIZERS:
            raise ConfigurationError(f"serializer must be one of {_SERIALIZERS}, got {self.serializer!r}")
        bad = [name for name in self.accept_content if name not in _SERIALIZERS]
        if bad:
            raise ConfigurationError(
                f"accept_content may hold only {_SERIALIZERS}; {bad} are unsafe or unknown"
            )
        if self.confirm not in ("pipelined", "each"):
            raise ConfigurationError(f"confirm must be 'pipelined' or 'each', got {self.confirm!r}")
        if self.publish_attempts < 1 or self.max_body_bytes < 1 or self.max_unconfirmed < 1:
            raise ConfigurationError("publish_attempts, max_body_bytes and max_unconfirmed must be positive")

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "broker_url"
        )
        return f"Settings(broker_url={redact_url(self.broker_url)!r}, {shown})"

    @property
    def virtual_host(self) -> str:
        """The vhost named by the URL path; ``//`` or an empty path mean ``/`` (as kombu reads it)."""
        return unquote(urlsplit(self.broker_url).path[1:]) or "/"

    @property
    def safe_broker_url(self) -> str:
        """The broker URL without its password."""
        return redact_url(self.broker_url)

    def with_options(self, **changes: Any) -> Settings:
        """Return a copy with some fields changed."""
        return replace(self, **changes)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Settings:
        """Settings for ``url``; other fields from keyword options or their defaults."""
        return cls(broker_url=url, **options)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **options: Any) -> Settings:
        """Settings from ``CLOCKWORK_*`` environment variables (call this in entry points only).

        Reads ``CLOCKWORK_BROKER_URL``, ``CLOCKWORK_DEFAULT_QUEUE``, ``CLOCKWORK_SERIALIZER``,
        ``CLOCKWORK_CONFIRM``, ``CLOCKWORK_MAX_BODY_BYTES``, ``CLOCKWORK_RESULT_EXPIRES_S``.
        Keyword options win over the environment.

        Raises:
            ConfigurationError: a variable holds an invalid value.
        """
        env = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        text_vars = {
            "broker_url": "CLOCKWORK_BROKER_URL",
            "default_queue": "CLOCKWORK_DEFAULT_QUEUE",
            "serializer": "CLOCKWORK_SERIALIZER",
            "confirm": "CLOCKWORK_CONFIRM",
        }
        int_vars = {
            "max_body_bytes": "CLOCKWORK_MAX_BODY_BYTES",
            "result_expires_s": "CLOCKWORK_RESULT_EXPIRES_S",
        }
        for name, var in text_vars.items():
            if env.get(var):
                found[name] = env[var]
        for name, var in int_vars.items():
            if env.get(var):
                try:
                    found[name] = int(env[var])
                except ValueError:
                    raise ConfigurationError(f"{var} must be an integer, got {env[var]!r}") from None
        found.update(options)
        return cls(**found)
