"""The mailbox's wire objects (Celery's pidbox format): requests, replies, and who a request is for."""

from __future__ import annotations

import fnmatch
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from broker_svc.errors import MessageError

__all__ = [
    "CLOCK_HEADER",
    "EXPIRES_HEADER",
    "MARKER_HEADER",
    "TICKET_HEADER",
    "ControlRequest",
    "ReplyAddress",
    "flatten_replies",
    "ok",
    "nok",
]

TICKET_HEADER: Final = "ticket"
CLOCK_HEADER: Final = "clock"
EXPIRES_HEADER: Final = "expires"
# A reader of one of our streams publishes a message with this header (a uuid) and reads until it
# sees it again: then it has read everything that was in the stream when it started.
MARKER_HEADER: Final = "x-clockwork-marker"

# A pattern is matched against every node name on every request: keep it short, so a hostile or
# mistaken regex cannot stall a worker's loop.
_MAX_PATTERN: Final = 256
_MAX_DESTINATIONS: Final = 10_000

Matcher = Literal["glob", "pcre"]


def ok(value: Any) -> dict[str, Any]:
    """Celery's success reply value: ``{"ok": value}``."""
    return {"ok": value}


def nok(value: Any) -> dict[str, Any]:
    """Celery's error reply value: ``{"error": value}``."""
    return {"error": value}


@dataclass(frozen=True, slots=True)
class ReplyAddress:
    """Where a reply goes: the reply exchange and the caller's routing key."""

    exchange: str
    routing_key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlRequest:
    """One mailbox request. A request with no ``reply_to``/``ticket`` is a cast (no reply)."""

    method: str
    arguments: dict[str, Any] = field(default_factory=dict)
    destination: tuple[str, ...] | None = None
    pattern: str | None = None
    matcher: Matcher | None = None
    ticket: str | None = None
    reply_to: ReplyAddress | None = None

    @property
    def wants_reply(self) -> bool:
        """True for a call, False for a cast."""
        return self.ticket is not None and self.reply_to is not None

    @staticmethod
    def new_ticket() -> str:
        """A fresh ticket (uuid4 string)."""
        return str(uuid.uuid4())

    def is_for(self, nodename: str) -> bool:
        """Whether the node named ``nodename`` must act on this request.

        A destination list wins; else a pattern (``glob``: fnmatch, ``pcre``: regex match); else
        every node.
        """
        if self.destination is not None:
            return nodename in self.destination
        if self.pattern is not None:
            if self.matcher == "pcre":
                try:
                    return re.match(self.pattern, nodename) is not None
                except re.error:
                    return False
            return fnmatch.fnmatchcase(nodename, self.pattern)
        return True

    def to_wire(self) -> dict[str, Any]:
        """The body map Celery's Mailbox sends."""
        body: dict[str, Any] = {
            "method": self.method,
            "arguments": self.arguments,
            "destination": list(self.destination) if self.destination is not None else None,
            "pattern": self.pattern,
            "matcher": self.matcher,
        }
        if self.wants_reply:
            assert self.reply_to is not None
            body["ticket"] = self.ticket
            body["reply_to"] = {"exchange": self.reply_to.exchange, "routing_key": self.reply_to.routing_key}
        return body

    @classmethod
    def from_wire(cls, body: Any) -> ControlRequest:
        """Validate a decoded request body.

        Raises:
            MessageError: the body is not a well-formed request.
        """
        if not isinstance(body, Mapping):
            raise MessageError(f"control request must be a map, got {type(body).__name__}")
        method = body.get("method")
        if not isinstance(method, str) or not method or len(method) > 128:
            raise MessageError("control request needs a method name")
        arguments = body.get("arguments") or {}
        if not isinstance(arguments, Mapping) or not all(isinstance(k, str) for k in arguments):
            raise MessageError("control request arguments must be a map with string keys")
        return cls(
            method=method,
            arguments=dict(arguments),
            destination=_destination(body.get("destination")),
            pattern=_pattern(body.get("pattern")),
            matcher=_matcher(body.get("matcher")),
            ticket=_optional_str(body, "ticket"),
            reply_to=_reply_address(body.get("reply_to")),
        )


def _destination(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):  # a lone name is accepted as a list of one
        return (value,)
    if not isinstance(value, list | tuple) or len(value) > _MAX_DESTINATIONS:
        raise MessageError("control request destination must be null or a list of node names")
    if not all(isinstance(v, str) for v in value):
        raise MessageError("control request destination must hold strings")
    return tuple(value)


def _pattern(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > _MAX_PATTERN:
        raise MessageError(f"control request pattern must be a string of at most {_MAX_PATTERN} characters")
    return value


def _matcher(value: Any) -> Matcher | None:
    if value in (None, "glob", "pcre"):
        return value  # type: ignore[no-any-return]
    raise MessageError(f"unknown matcher {value!r}; use glob or pcre")


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None or (isinstance(value, str) and len(value) <= 256):
        return value
    raise MessageError(f"control request {key} must be a string")


def _reply_address(value: Any) -> ReplyAddress | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise MessageError("control request reply_to must be a map")
    exchange, routing_key = value.get("exchange"), value.get("routing_key")
    if not isinstance(exchange, str) or not isinstance(routing_key, str):
        raise MessageError("control request reply_to needs exchange and routing_key strings")
    return ReplyAddress(exchange, routing_key)


def flatten_replies(replies: list[Any]) -> dict[str, Any]:
    """Turn the list of one-entry reply maps into ``{nodename: value}`` (the last reply wins).

    Replies that are not one-entry maps with a string key are skipped.
    """
    flat: dict[str, Any] = {}
    for reply in replies:
        if isinstance(reply, Mapping) and len(reply) == 1:
            [(node, value)] = reply.items()
            if isinstance(node, str):
                flat[node] = value
    return flat
