"""Celery's stamps on a task message, and the ``headers`` argument of a revoke by stamps.

A stamped signature keeps each stamp as a send option of its own, and lists their names in the
``stamped_headers`` option; a task message carries the names in its ``stamped_headers`` header and
the values in its ``stamps`` header (Celery 5.3+, ``as_task_v2``). A worker reads only the stamps
that ``stamped_headers`` names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = ["MAX_REVOKED_VALUES", "message_stamps", "revoke_headers", "task_stamps"]

# One revoke names at most this many stamp values: a revoke travels in one control message and
# one revocation-log entry.
MAX_REVOKED_VALUES: Final = 10_000
_MAX_NAME: Final = 256
_SCALARS: Final = (str, int, float)  # bool is an int


def message_stamps(options: Mapping[str, Any]) -> tuple[list[str] | None, dict[str, Any]]:
    """The ``stamped_headers`` and ``stamps`` headers of a task sent with these send options.

    As Celery's client: the names the ``stamped_headers`` option lists, each with the value of the
    send option of that name (None when it has none). Unstamped: ``(None, {})``.

    Raises:
        TypeError: ``stamped_headers`` is not a list of names.
    """
    names = options.get("stamped_headers")
    if names is None:
        return None, {}
    if not isinstance(names, list | tuple) or not all(isinstance(name, str) for name in names):
        raise TypeError("stamped_headers must be a list of option names")
    listed = list(dict.fromkeys(names))
    return listed, {name: _listed(options.get(name)) for name in listed}


def _listed(value: Any) -> Any:
    # A header carries lists, never tuples (DESIGN §2).
    return [_listed(item) for item in value] if isinstance(value, list | tuple) else value


def task_stamps(stamped_headers: list[str] | None, stamps: Mapping[str, Any] | None) -> dict[str, Any]:
    """The stamps a worker sees on a task: each name ``stamped_headers`` lists, with its value
    from ``stamps`` (None when missing), as Celery's ``Request.stamps``."""
    if not stamped_headers:
        return {}
    found = stamps or {}
    return {name: found.get(name) for name in stamped_headers}


def revoke_headers(headers: Any) -> dict[str, list[Any]]:
    """The stamps a revoke names, each as a list of values.

    ``headers`` as Celery's ``revoke_by_stamped_headers`` takes it: a map of stamp name to a value
    or a list of values, or (as Celery's command line sends it) a list of ``"name=value"``.

    Raises:
        ValueError: not a map or a list of ``name=value``, a name that is not a short non-empty
            string, a value that is not a string or number (or a list of them), or too many values.
    """
    if isinstance(headers, list | tuple):
        pairs: dict[str, Any] = {}
        for item in headers:
            if not isinstance(item, str) or "=" not in item:
                raise ValueError(f"headers given as a list hold 'name=value' strings, got {item!r}")
            name, value = item.split("=", 1)
            pairs[name] = value
        headers = pairs
    if not isinstance(headers, Mapping):
        raise ValueError(f"headers must be a map of stamp name to value(s), got {type(headers).__name__}")
    revoked: dict[str, list[Any]] = {}
    count = 0
    for name, value in headers.items():
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
            raise ValueError(
                f"a stamp name is a non-empty string of at most {_MAX_NAME} characters, not {name!r}"
            )
        values = list(value) if isinstance(value, list | tuple) else [value]
        for item in values:
            if not isinstance(item, _SCALARS):
                raise ValueError(f"stamp {name!r}: a revoked value is a string or a number, got {item!r}")
        count += len(values)
        revoked[name] = values
    if count > MAX_REVOKED_VALUES:
        raise ValueError(f"a revoke names at most {MAX_REVOKED_VALUES} stamp values, got {count}")
    return revoked
