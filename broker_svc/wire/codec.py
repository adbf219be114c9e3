"""Body codecs: msgpack and json (kombu-compatible), an accept list, and a size limit.

Only these two are ever decoded: the content type is checked *before* a body is touched, so a
pickle or yaml payload is refused unread.
"""

from __future__ import annotations

import base64
import bz2
import datetime as dt
import decimal
import json
import lzma
import uuid
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Final, NoReturn

import msgpack

from broker_svc.errors import ContentDisallowed, DecodeError, MessageTooLarge

__all__ = [
    "reply_type",
    "JSON",
    "MSGPACK",
    "accept_set",
    "content_type_of",
    "decode",
    "decompress",
    "refuse_ext",
    "encode",
]

MSGPACK: Final = "application/x-msgpack"
JSON: Final = "application/json"

_BY_NAME: Final = {"msgpack": (MSGPACK, "binary"), "json": (JSON, "utf-8")}
_ALIASES: Final = {"msgpack": MSGPACK, "json": JSON, MSGPACK: MSGPACK, JSON: JSON}


def content_type_of(serializer: str) -> tuple[str, str]:
    """Return ``(content_type, content_encoding)`` for a serializer name or content type.

    Raises:
        ContentDisallowed: the serializer is not msgpack or json.
    """
    content_type = _ALIASES.get(serializer)
    if content_type is None:
        raise ContentDisallowed(f"serializer {serializer!r} is not supported (use msgpack or json)")
    return _BY_NAME["msgpack" if content_type == MSGPACK else "json"]


def accept_set(names: Iterable[str]) -> frozenset[str]:
    """Turn serializer names or content types into the set of accepted content types.

    Raises:
        ContentDisallowed: a name is not msgpack or json.
    """
    return frozenset(content_type_of(name)[0] for name in names)


def encode(value: Any, serializer: str) -> tuple[bytes, str, str]:
    """Encode ``value``.

    Returns:
        ``(body, content_type, content_encoding)``.

    Raises:
        ContentDisallowed: unknown serializer.
        TypeError: the value holds something the serializer cannot represent.
    """
    content_type, encoding = content_type_of(serializer)
    if content_type == MSGPACK:
        try:
            return msgpack.packb(value, use_bin_type=True), content_type, encoding
        except (OverflowError, TypeError, ValueError) as exc:  # ints beyond 64 bits, objects
            raise TypeError(f"msgpack cannot encode this value: {exc}") from exc
    text = json.dumps(value, default=_json_default, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8"), content_type, encoding


def decode(body: bytes, content_type: str | None, *, accept: frozenset[str], max_bytes: int) -> Any:
    """Decode a body, refusing what is not accepted or too large before reading it.

    Raises:
        MessageTooLarge: ``len(body) > max_bytes``.
        ContentDisallowed: the content type is not in ``accept``.
        DecodeError: the body is not valid for its content type.
    """
    if len(body) > max_bytes:
        raise MessageTooLarge(f"body of {len(body)} bytes is over the limit of {max_bytes}")
    if content_type not in accept:
        raise ContentDisallowed(f"refusing content type {content_type!r}; accepted: {sorted(accept)}")
    try:
        if content_type == MSGPACK:
            return msgpack.unpackb(
                body,
                raw=False,
                strict_map_key=False,
                ext_hook=refuse_ext,
            )
        text = body.decode("utf-8")
        if text.startswith("\ufeff"):  # as json.loads says it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _JSON_DECODER.decode(text)
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError, msgpack.ExtraData) as exc:
        raise DecodeError(f"cannot decode {content_type} body of {len(body)} bytes: {exc}") from exc
    except Exception as exc:  # msgpack raises a few private error types; none may escape raw
        raise DecodeError(f"cannot decode {content_type} body: {type(exc).__name__}: {exc}") from exc


def decompress(body: bytes, compression: object, *, max_bytes: int) -> bytes:
    """Undo Celery's optional body compression (header ``compression``), bounded by ``max_bytes``.

    The bound applies to the output, so a small compressed bomb cannot exhaust memory.

    Raises:
        ContentDisallowed: unknown compression.
        DecodeError: the body does not decompress.
        MessageTooLarge: the output would exceed ``max_bytes``.
    """
    try:
        if compression in ("application/x-gzip", "zlib", "gzip"):
            zstream = zlib.decompressobj()
            out = zstream.decompress(body, max_bytes + 1)
        elif compression in ("application/x-bz2", "bzip2"):
            out = bz2.BZ2Decompressor().decompress(body, max_bytes + 1)
        elif compression in ("application/x-lzma", "lzma"):
            out = lzma.LZMADecompressor().decompress(body, max_bytes + 1)
        else:
            raise ContentDisallowed(f"compression {compression!r} is not supported")
    except (zlib.error, OSError, lzma.LZMAError, EOFError) as exc:
        raise DecodeError(f"cannot decompress ({compression}): {exc}") from exc
    if len(out) > max_bytes:
        raise MessageTooLarge(f"decompressed body is over the limit of {max_bytes} bytes")
    return out


def refuse_ext(code: int, data: bytes) -> NoReturn:
    """msgpack ``ext_hook`` that refuses every ext type: none of our formats uses one."""
    raise ValueError(f"msgpack ext type {code} is not accepted")


def _json_default(value: Any) -> Any:
    # kombu >= 5.3 wraps these types the same way, so Celery decodes what we send and vice versa.
    if isinstance(value, dt.datetime):
        return {"__type__": "datetime", "__value__": value.isoformat()}
    if isinstance(value, dt.date):
        return {"__type__": "date", "__value__": value.isoformat()}
    if isinstance(value, dt.time):
        return {"__type__": "time", "__value__": value.isoformat()}
    if isinstance(value, decimal.Decimal):
        return {"__type__": "decimal", "__value__": str(value)}
    if isinstance(value, uuid.UUID):
        return {"__type__": "uuid", "__value__": {"hex": value.hex}}  # kombu 5.7's form
    if isinstance(value, bytes):
        try:
            return {"__type__": "bytes", "__value__": value.decode("utf-8")}
        except UnicodeDecodeError:
            return {"__type__": "base64", "__value__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    raise TypeError(f"object of type {type(value).__name__} is not JSON serializable")


_JSON_TYPES: Final[dict[str, Callable[[Any], Any]]] = {
    "datetime": dt.datetime.fromisoformat,
    "date": lambda v: dt.datetime.fromisoformat(v).date(),
    "time": dt.time.fromisoformat,
    "decimal": decimal.Decimal,
    # kombu 5.7 writes {"hex": ...}; a plain hex string is read too.
    "uuid": lambda v: uuid.UUID(**v) if isinstance(v, dict) else uuid.UUID(hex=v),
    "bytes": lambda v: v.encode("utf-8"),
    "base64": base64.b64decode,
}


def _json_object_hook(obj: dict[str, Any]) -> Any:
    if len(obj) == 2 and "__type__" in obj and "__value__" in obj:
        converter = _JSON_TYPES.get(obj["__type__"])
        if converter is not None:
            return converter(obj["__value__"])
    return obj


# json.loads given object_hook builds a new decoder per call, half of a task body's decoding.
_JSON_DECODER: Final = json.JSONDecoder(object_hook=_json_object_hook)


def serializer_of(content_type: str | None) -> str | None:
    """The serializer's name (``json``, ``msgpack``) of a content type; None for any other."""
    return {JSON: "json", MSGPACK: "msgpack"}.get(content_type or "")


def reply_type(content_type: str | None) -> str:
    """The content type a task's results go out in: the request's own; json for a refused one.

    Every Celery client reads json, so a request in a type we refused still gets its answer.
    """
    return content_type if content_type in (MSGPACK, JSON) else JSON
