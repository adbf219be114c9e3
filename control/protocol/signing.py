"""Signed control messages: an HMAC over the body and every header that changes what it does.

A sender with the shared key adds three headers: a timestamp, a random nonce and an HMAC-SHA256
of the message kind (request or reply), the exchange it is published to, its content type and
encoding, the headers in ``SIGNED_HEADERS``, the timestamp, the nonce and the body. A receiver
with the key refuses what is unsigned, does not match, is outside the time window, or reuses a
nonce seen within it. Celery peers cannot sign: a worker with a key shuts them out of its control
plane, which is the point.

Separately, an allow-list of broker users: the broker guarantees ``user_id`` equals the login of
the connection that published the message (or refuses it), so it names the sender.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import Any, Final, Literal, Protocol
from urllib.parse import unquote, urlsplit

from broker_svc.settings import Settings
from control.protocol.request import CLOCK_HEADER, EXPIRES_HEADER, TICKET_HEADER
from control.protocol.revoke_log import LOGGED_HEADER

__all__ = [
    "NONCE_HEADER",
    "SIGNATURE_HEADER",
    "SIGNED_HEADERS",
    "TIMESTAMP_HEADER",
    "ControlSecurity",
    "Kind",
    "Received",
    "Refusal",
    "login_of",
]

SIGNATURE_HEADER: Final = "x-clockwork-signature"
TIMESTAMP_HEADER: Final = "x-clockwork-timestamp"
NONCE_HEADER: Final = "x-clockwork-nonce"
# Headers a receiver acts on: a changed ticket, clock, expiry or "already logged" flag must break
# the signature. Other headers are not signed (peers may add their own).
SIGNED_HEADERS: Final = (TICKET_HEADER, CLOCK_HEADER, EXPIRES_HEADER, LOGGED_HEADER)
_VERSION: Final = b"clockwork-control-v1"
_MAX_NONCE: Final = 64

Kind = Literal["request", "reply"]


class Received(Protocol):
    """What a check reads of a received message (an aio-pika ``IncomingMessage`` has it all)."""

    @property
    def exchange(self) -> str | None: ...
    @property
    def body(self) -> bytes: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def content_encoding(self) -> str | None: ...
    @property
    def headers(self) -> Mapping[str, Any]: ...
    @property
    def user_id(self) -> str | None: ...


class Refusal(StrEnum):
    """Why a control message was not acted on."""

    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    STALE = "stale"
    REPLAYED = "replayed"
    NO_USER_ID = "no_user_id"
    USER_NOT_ALLOWED = "user_not_allowed"


def login_of(broker_url: str) -> str | None:
    """The user name in an AMQP URL (what the broker checks ``user_id`` against), if it names one."""
    user = urlsplit(broker_url).username
    return unquote(user) if user else None


class ControlSecurity:
    """Signs what a process sends on the control plane and checks what it receives.

    With no key and no allow-list, nothing is signed and everything is accepted (Celery's
    behaviour). Nonces are remembered per process, so a message signed before this object was
    made is refused as stale: a restarted worker cannot be replayed at. The nonce cache is
    bounded: when it is full the oldest nonce is dropped and nothing at or before its timestamp is
    accepted any more, so a dropped nonce cannot be replayed either.

    Args:
        key: the shared secret (None: no signing).
        allowed_users: broker users whose commands are acted on (empty: anyone).
        user_id: our own login, stamped as ``user_id`` on what we send (None: not stamped).
        window_s: how far a timestamp may be from our clock, either way.
        max_nonces: nonces remembered at most.
        now: the wall clock (for tests).

    Raises:
        ValueError: an empty key, or a window or cache size that is not positive.
    """

    __slots__ = (
        "_floor",
        "_key",
        "_max_nonces",
        "_nonces",
        "_now",
        "_started",
        "allowed_users",
        "user_id",
        "window_s",
    )

    def __init__(
        self,
        *,
        key: str | bytes | None = None,
        allowed_users: Iterable[str] = (),
        user_id: str | None = None,
        window_s: float = 60.0,
        max_nonces: int = 100_000,
        now: Callable[[], float] = time.time,
    ) -> None:
        if key is not None and not key:
            raise ValueError("the control signing key must not be empty (use None for no signing)")
        if window_s <= 0 or max_nonces < 1:
            raise ValueError("window_s and max_nonces must be positive")
        self._key = key.encode() if isinstance(key, str) else key
        self.allowed_users = frozenset(allowed_users)
        self.user_id = user_id
        self.window_s = window_s
        self._max_nonces = max_nonces
        self._now = now
        self._nonces: OrderedDict[str, float] = OrderedDict()  # nonce -> its timestamp
        self._floor = float("-inf")  # nothing at or before this is accepted (evicted nonces)
        self._started = now()  # nothing before this either (nonces seen by an earlier process)

    @classmethod
    def from_settings(cls, settings: Settings) -> ControlSecurity:
        """The key and allow-list from ``settings``; our login from its broker URL."""
        return cls(
            key=settings.control_signing_key,
            allowed_users=settings.control_allowed_users,
            user_id=login_of(settings.broker_url),
        )

    def __repr__(self) -> str:
        return (
            f"ControlSecurity(signing={self.signing}, allowed_users={sorted(self.allowed_users)!r}, "
            f"user_id={self.user_id!r}, window_s={self.window_s})"
        )

    @property
    def signing(self) -> bool:
        """Whether messages are signed and checked."""
        return self._key is not None

    def sign(
        self,
        kind: Kind,
        *,
        exchange: str,
        body: bytes,
        content_type: str | None,
        content_encoding: str | None,
        headers: Mapping[str, Any],
    ) -> dict[str, Any]:
        """``headers`` plus the signature headers (unchanged when there is no key)."""
        out = dict(headers)
        if self._key is None:
            return out
        out[TIMESTAMP_HEADER] = f"{self._now():.3f}"
        out[NONCE_HEADER] = secrets.token_hex(16)
        out[SIGNATURE_HEADER] = self._mac(kind, exchange, body, content_type, content_encoding, out)
        return out

    def check_received(self, kind: Kind, message: Received) -> Refusal | None:
        """:meth:`check` a received message."""
        return self.check(
            kind,
            exchange=message.exchange or "",
            body=message.body,
            content_type=message.content_type,
            content_encoding=message.content_encoding,
            headers=message.headers or {},
            user_id=message.user_id,
        )

    def check(
        self,
        kind: Kind,
        *,
        exchange: str,
        body: bytes,
        content_type: str | None,
        content_encoding: str | None,
        headers: Mapping[str, Any],
        user_id: str | None,
    ) -> Refusal | None:
        """None when the message may be acted on, else why not (see :meth:`check_received`).

        A message that passes has its nonce remembered: the same message again is ``REPLAYED``.
        The allow-list applies to requests only (replies come from workers, not operators).
        """
        if self.allowed_users and kind == "request":
            if not user_id:
                return Refusal.NO_USER_ID
            if user_id not in self.allowed_users:
                return Refusal.USER_NOT_ALLOWED
        if self._key is None:
            return None
        signature, stamp, nonce = (headers.get(h) for h in (SIGNATURE_HEADER, TIMESTAMP_HEADER, NONCE_HEADER))
        if not (isinstance(signature, str) and isinstance(stamp, str) and isinstance(nonce, str)):
            return Refusal.UNSIGNED
        if len(nonce) > _MAX_NONCE:
            return Refusal.BAD_SIGNATURE
        expected = self._mac(kind, exchange, body, content_type, content_encoding, headers)
        if not hmac.compare_digest(signature, expected):
            return Refusal.BAD_SIGNATURE
        try:
            sent_at = float(stamp)
        except ValueError:
            return Refusal.BAD_SIGNATURE  # cannot happen with the key, unless the sender is broken
        now = self._now()
        if not abs(now - sent_at) <= self.window_s or sent_at <= self._floor or sent_at < self._started:
            return Refusal.STALE
        if nonce in self._nonces:
            return Refusal.REPLAYED
        self._remember(nonce, sent_at, now)
        return None

    def _remember(self, nonce: str, sent_at: float, now: float) -> None:
        # Insertion order is close to time order; drop what has left the window from the front.
        while self._nonces:
            oldest, stamp = next(iter(self._nonces.items()))
            if stamp >= now - self.window_s:
                break
            del self._nonces[oldest]
        while len(self._nonces) >= self._max_nonces:
            _, stamp = self._nonces.popitem(last=False)
            self._floor = max(self._floor, stamp)
        self._nonces[nonce] = sent_at

    def _mac(
        self,
        kind: Kind,
        exchange: str,
        body: bytes,
        content_type: str | None,
        content_encoding: str | None,
        headers: Mapping[str, Any],
    ) -> str:
        assert self._key is not None
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        fields = [
            _VERSION,
            kind.encode(),
            exchange.encode(),
            _canonical(content_type),
            _canonical(content_encoding),
            *(_canonical(headers.get(name)) for name in (*SIGNED_HEADERS, TIMESTAMP_HEADER, NONCE_HEADER)),
            body,
        ]
        for value in fields:  # length-prefixed, so no field's bytes can pass for another's
            mac.update(b"%d:" % len(value))
            mac.update(value)
        return mac.hexdigest()


def _canonical(value: object) -> bytes:
    # The same header reads back as the same bytes from pika and from aio-pika.
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"true" if value else b"false"
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    return repr(value).encode()
