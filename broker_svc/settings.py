"""Settings: one frozen dataclass, built from a URL or the environment."""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Final, Literal, get_type_hints
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from broker_svc.errors import ConfigurationError
from broker_svc.topology import LEGACY_NAMESPACE, QueueSpec, QueueType, app_namespace, task_queue

__all__ = [
    "DEFAULT_BROKER_URL",
    "ConfirmMode",
    "Settings",
    "env_vars",
    "redact_url",
    "split_names",
    "split_urls",
]

DEFAULT_BROKER_URL = "amqp://guest:guest@127.0.0.1:5672//"

ConfirmMode = Literal["pipelined", "each"]

_SERIALIZERS = ("msgpack", "json")


def split_names(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` → ``("a", "b", "c")``: a comma-separated list of names (queues, users)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


# URL query options naming TLS files (aio-pika's names); read here, removed before a client sees the URL.
_TLS_QUERY_KEYS = ("cafile", "certfile", "keyfile")


def split_urls(url: str) -> tuple[str, ...]:
    """The URLs of a failover list ``"amqp://a//;amqp://b//"`` (kombu's syntax), in order."""
    return tuple(part.strip() for part in url.split(";") if part.strip())


def redact_url(url: str) -> str:
    """Return ``url`` (or each URL of a ``;`` list) with its password replaced by ``***``.

    Used for logs, reprs and errors. A URL that does not parse loses everything between ``//``
    and ``@`` instead, so a password is never shown, whatever it holds.
    """
    if ";" in url:
        return ";".join(redact_url(part) for part in split_urls(url))
    try:
        parts = urlsplit(url)
        password = parts.password
        user = parts.username or ""
    except ValueError:
        return re.sub(r"//[^/]*@", "//***@", url)
    if password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _without_tls_query(url: str) -> str:
    parts = urlsplit(url)
    if not parts.query:
        return url
    kept = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _TLS_QUERY_KEYS]
    return urlunsplit(parts._replace(query=urlencode(kept)))


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a client or worker needs to talk to the broker.

    The AMQP URL is the single connection source. Units are in the names.

    Attributes:
        broker_url: ``amqp://user:password@host:port/vhost`` (``//`` is the default vhost), or
            several separated by ``;`` (kombu's failover list): connections try them in order and
            move to the next one when a connection is lost or an attempt fails. All must name the
            same vhost. ``amqps://`` uses TLS; the query options ``cafile``, ``certfile`` and
            ``keyfile`` name TLS files (the ``ssl_*`` fields win over them).
        default_queue: where tasks go when no queue is named (Celery's ``celery``).
        serializer: how our client encodes task bodies: ``msgpack`` (default) or ``json``.
        accept_content: content types a receiver decodes; never pickle or yaml.
        max_body_bytes: bodies larger than this are refused on publish and dead-lettered on receive.
        quorum_queues: task queues declared as quorum queues (``x-queue-type: quorum``, as Celery
            declares them with ``task_default_queue_type`` or ``task_create_missing_queue_type``
            ``"quorum"``); every other task queue is classic, as Celery's default. Clients and
            workers sharing a queue must agree, or RabbitMQ refuses the second declaration (406
            PRECONDITION_FAILED).
        ordered_queues: task queues declared ordered (``x-single-active-consumer``): one consumer
            of all workers runs their tasks, one at a time, in the order they were published, and
            the next consumer takes over when it goes (docs/guide.md, "Ordered queues"). Clients
            and workers must agree, as for ``quorum_queues``.
        queue_max_priority: declare classic task queues as priority queues with this many levels
            (``x-max-priority``; Celery's ``task_queue_max_priority``): a task's ``priority``
            (``at_front=True``: 9) then puts it ahead of lower ones. None (default): no priorities,
            as Celery's default. Clients and workers must agree, as for ``quorum_queues``.
        delivery_limit: how often a worker lets one message start without finishing (its worker
            or child died) before the next delivery goes to ``<queue>.dead`` instead (reason
            ``delivery_limit``): a poison task runs at most ``delivery_limit + 1`` times.
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
        task_states: write every task's states to the task-state stream (QUEUED from the client,
            the rest from workers; docs/guide.md, "Jobs and states"), so any process can read them.
        control_signing_key: shared secret for signed control messages (HMAC-SHA256); when set, a
            worker refuses unsigned commands. Never shown in reprs or logs.
        control_allowed_users: when not empty, a worker acts only on commands whose AMQP
            ``user_id`` is one of these broker users.
        ssl_context: the TLS context for ``amqps://`` URLs (client certificate, CAs, checks); when
            None, one is made from the ``ssl_*_file`` options, else the system's default context.
        ssl_ca_file: CA bundle (PEM) that must have signed the broker's certificate.
        ssl_cert_file: client certificate (PEM), for brokers that require one (mutual TLS).
        ssl_key_file: the client certificate's private key (PEM); omit it if the key is in
            ``ssl_cert_file``.
        spool_dir: turns the producer's disk spool on (docs/guide.md, "When the broker is down"):
            a call returns once its task is in the spool, and a background drain publishes the
            spool in order with confirms. Each process takes a slot directory under it.
        spool_max_bytes: the most the spool holds (on disk and in its buffer); past it a call
            raises ``SpoolFull``.
        spool_memory_records: tasks kept in memory for the drain; older ones are read back from disk.
        spool_flush_count: count trigger: buffered tasks are written to the spool file once this
            many wait (by the call that reaches the count; 1 writes every task before its call returns).
        spool_flush_interval_s: time trigger: buffered tasks are written at least this often.
        spool_fsync: each write of the spool is followed by fsync (survives a machine crash);
            without it, writes survive a crash of the process but not of the machine.
        app_namespace: the key of the state an app's clients and workers share in the vhost
            (chords, dedup gates, dependents, task states, revokes, schedulers; docs/guide.md,
            "Many apps on one broker"); apps sharing a vhost set one each, on their clients and
            workers alike. None: ``celery``, the names of earlier releases (``namespace`` is the
            one in effect).
    """

    broker_url: str = field(default=DEFAULT_BROKER_URL, repr=False)
    default_queue: str = "celery"
    serializer: str = "msgpack"
    accept_content: tuple[str, ...] = ("msgpack", "json")
    max_body_bytes: int = 10 * 1024 * 1024
    quorum_queues: tuple[str, ...] = ()
    ordered_queues: tuple[str, ...] = ()
    queue_max_priority: int | None = None
    delivery_limit: int = 3
    confirm: ConfirmMode = "pipelined"
    publish_attempts: int = 3
    max_unconfirmed: int = 50_000
    confirm_timeout_s: float = 30.0
    connect_timeout_s: float = 10.0
    reconnect_window_s: float = 30.0
    heartbeat_s: int = 30
    result_expires_s: int = 86_400
    result_persistent: bool = False
    task_states: bool = False
    control_signing_key: str | None = field(default=None, repr=False)
    control_allowed_users: tuple[str, ...] = ()
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    ssl_ca_file: str | None = None
    ssl_cert_file: str | None = None
    ssl_key_file: str | None = None
    spool_dir: str | None = None
    spool_max_bytes: int = 1024 * 1024 * 1024
    spool_memory_records: int = 10_000
    spool_flush_count: int = 256
    spool_flush_interval_s: float = 0.1
    spool_fsync: bool = True
    app_namespace: str | None = None

    def __post_init__(self) -> None:
        _check_urls(self.broker_url)
        try:
            app_namespace(self.app_namespace)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        if self.ssl_key_file and not self.ssl_cert_file:
            raise ConfigurationError("ssl_key_file needs ssl_cert_file (the certificate it belongs to)")
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
        if self.delivery_limit < 0:
            raise ConfigurationError(f"delivery_limit must not be negative, got {self.delivery_limit}")
        if self.spool_dir is not None:
            _check_spool(self)

    def __repr__(self) -> str:
        # Fields with repr=False (the URL, the control key, the SSL context) are never shown.
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return f"Settings(broker_url={redact_url(self.broker_url)!r}, {shown})"

    @property
    def namespace(self) -> str:
        """The app namespace in effect: ``app_namespace`` (checked when the settings were made),
        else ``celery``. Read for every delivery, so it is a lookup, not a check."""
        return self.app_namespace or LEGACY_NAMESPACE

    @property
    def virtual_host(self) -> str:
        """The vhost named by the URL path; ``//`` or an empty path mean ``/`` (as kombu reads it)."""
        return _vhost(split_urls(self.broker_url)[0])

    @property
    def broker_urls(self) -> tuple[str, ...]:
        """The URLs to connect to, in failover order, without the TLS file query options."""
        return tuple(_without_tls_query(url) for url in split_urls(self.broker_url))

    def tls_context(self, url: str) -> ssl.SSLContext | None:
        """The TLS context for a connection to ``url`` (one of ``broker_url``'s); None for ``amqp://``.

        ``ssl_context`` if set; else a context that checks the broker's certificate and host
        name against ``ssl_ca_file`` (else the system's CAs) and presents ``ssl_cert_file``.

        Raises:
            ConfigurationError: a TLS file cannot be read or does not hold what it should.
        """
        parts = urlsplit(url)
        if parts.scheme != "amqps":
            return None
        if self.ssl_context is not None:
            return self.ssl_context
        query = dict(parse_qsl(parts.query))
        ca_file = self.ssl_ca_file or query.get("cafile")
        cert_file = self.ssl_cert_file or query.get("certfile")
        key_file = self.ssl_key_file or (None if self.ssl_cert_file else query.get("keyfile"))
        try:
            context = ssl.create_default_context(cafile=ca_file)
            if cert_file:
                context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"cannot load the TLS files: {exc}") from exc
        return context

    @property
    def safe_broker_url(self) -> str:
        """The broker URL without its password."""
        return redact_url(self.broker_url)

    def queue_type(self, queue: str) -> QueueType:
        """``quorum`` for a queue named in ``quorum_queues``, else ``classic``."""
        return "quorum" if queue in self.quorum_queues else "classic"

    def task_queue(self, queue: str) -> QueueSpec:
        """How ``queue`` is declared here: its type, and ordered if named in ``ordered_queues``."""
        return task_queue(
            queue,
            queue_type=self.queue_type(queue),
            single_active=queue in self.ordered_queues,
            max_priority=self.queue_max_priority,
        )

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

        Each field is read from ``CLOCKWORK_<FIELD>`` (``broker_url`` from ``CLOCKWORK_BROKER_URL``,
        ``confirm_timeout_s`` from ``CLOCKWORK_CONFIRM_TIMEOUT_S``, ...), except ``ssl_context``,
        which is an object. Lists are comma-separated, booleans ``1/true/yes/on`` or
        ``0/false/no/off``; an empty variable counts as unset. ``control_signing_key`` is also read
        from ``CLOCKWORK_CONTROL_KEY`` and ``control_allowed_users`` from ``CLOCKWORK_CONTROL_USERS``
        (older names, kept as aliases; the field's own name wins). Keyword options win over the
        environment.

        Raises:
            ConfigurationError: a variable holds an invalid value.
        """
        return cls(**{**cls.env_options(environ), **options})

    @classmethod
    def env_options(cls, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The fields that ``CLOCKWORK_*`` variables set, by field name (see ``from_env``).

        Raises:
            ConfigurationError: a variable holds an invalid value.
        """
        env = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        hints = get_type_hints(cls)
        for name, names in env_vars().items():
            var = next((v for v in names if env.get(v)), None)
            if var is not None:
                found[name] = _from_text(hints[name], var, env[var])
        return found


# Fields also read from an older variable name, which stays an alias.
_ENV_ALIASES: Final = {
    "control_signing_key": "CLOCKWORK_CONTROL_KEY",
    "control_allowed_users": "CLOCKWORK_CONTROL_USERS",
}
# Not read from the environment: an object, not text.
_NOT_FROM_ENV: Final = frozenset({"ssl_context"})
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_vars() -> dict[str, tuple[str, ...]]:
    """Each ``Settings`` field ``from_env`` reads, with its variables: ``CLOCKWORK_<FIELD>`` first,
    then its alias if it has one."""
    return {
        f.name: (f"CLOCKWORK_{f.name.upper()}", *([_ENV_ALIASES[f.name]] if f.name in _ENV_ALIASES else []))
        for f in fields(Settings)
        if f.name not in _NOT_FROM_ENV
    }


def _from_text(hint: Any, var: str, text: str) -> Any:
    # The field's type says how its variable reads; str, optional str and Literal stay text.
    if hint == int | None or hint == float | None:  # an optional number: set, it is a number
        hint = int if hint == int | None else float
    if hint is int or hint is float:
        try:
            return hint(text)
        except ValueError:
            kind = "an integer" if hint is int else "a number"
            raise ConfigurationError(f"{var} must be {kind}, got {text!r}") from None
    if hint is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ConfigurationError(f"{var} must be one of {_TRUE + _FALSE}, got {text!r}")
        return text.lower() in _TRUE
    if hint == tuple[str, ...]:
        return split_names(text)
    return text


def _vhost(url: str) -> str:
    return unquote(urlsplit(url).path[1:]) or "/"


def _check_urls(broker_url: str) -> None:
    urls = split_urls(broker_url)
    if not urls:
        raise ConfigurationError("broker_url is empty; give amqp://user:password@host:port/vhost")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("amqp", "amqps"):
            raise ConfigurationError(
                f"broker URL must start with amqp:// or amqps://, got {redact_url(url)!r}"
            )
        try:
            parts.port  # noqa: B018 - parsing it is the check
        except ValueError:
            raise ConfigurationError(f"broker URL has an invalid port: {redact_url(url)!r}") from None
    vhosts = {_vhost(url) for url in urls}
    if len(vhosts) > 1:
        # Failover moves a client between brokers of one cluster; its queues live in one vhost.
        raise ConfigurationError(
            f"every URL of a failover list must name the same vhost, got {sorted(vhosts)}"
        )


def _check_spool(settings: Settings) -> None:
    if settings.confirm == "each":
        # With a spool a call returns once the task is spooled; the drain waits for the confirm.
        raise ConfigurationError(
            "spool_dir and confirm='each' exclude each other: with a spool a call returns once the "
            "task is spooled; set spool_flush_count=1 to have each call write its task to disk first"
        )
    if settings.spool_flush_count < 1 or settings.spool_max_bytes < 1 or settings.spool_flush_interval_s <= 0:
        raise ConfigurationError(
            "spool_flush_count, spool_max_bytes and spool_flush_interval_s must be positive"
        )
    if settings.spool_memory_records < settings.spool_flush_count:
        # Only written tasks may leave memory, and up to spool_flush_count wait to be written.
        raise ConfigurationError(
            f"spool_memory_records ({settings.spool_memory_records}) must be at least "
            f"spool_flush_count ({settings.spool_flush_count})"
        )
