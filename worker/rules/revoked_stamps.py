"""Stamp values revoked by ``revoke_by_stamped_headers``, and the stamped tasks they match.

Celery's rule (``Request.revoked``): a task is revoked when one of the stamps its
``stamped_headers`` lists has a value (or, for a list, any value) among those revoked under that
stamp's name. As in Celery a running worker keeps them for its life, not only for the revoked
ids' expiry; we bound their number, the oldest going first. Pure: the worker's main process and
each consuming child keep one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

__all__ = ["MAX_VALUES", "RevokedStamps"]

MAX_VALUES: Final = 50_000  # as many as revoked ids (worker/remote/revoked_set.py)


class RevokedStamps:
    """Revoked stamp values by stamp name, at most ``max_values`` of them."""

    def __init__(self, *, max_values: int = MAX_VALUES) -> None:
        self._max = max_values
        self._entries: OrderedDict[tuple[str, Any], None] = OrderedDict()

    @classmethod
    def of(cls, headers: Mapping[str, Iterable[Any]]) -> RevokedStamps:
        """Just the values ``headers`` names (one revoke's, to find the running tasks it ends)."""
        revoked = cls()
        revoked.add(headers)
        return revoked

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, headers: Mapping[str, Iterable[Any]]) -> dict[str, list[Any]]:
        """Revoke these values (each name's list); returns those that were not revoked before."""
        new: dict[str, list[Any]] = {}
        for name, values in headers.items():
            for value in values:
                key = (name, value)
                if key in self._entries:
                    continue
                self._entries[key] = None
                new.setdefault(name, []).append(value)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        return new

    def to_wire(self) -> dict[str, list[Any]]:
        """Every revoked value, by name (what a consuming child is told when it starts)."""
        found: dict[str, list[Any]] = {}
        for name, value in self._entries:
            found.setdefault(name, []).append(value)
        return found

    def matching(self, stamps: Mapping[str, Any]) -> tuple[str, Any] | None:
        """The first ``(name, value)`` of a task's stamps that is revoked, or None.

        ``stamps`` are the task's stamps as its ``stamped_headers`` lists them
        (``broker_svc.wire.task.stamps.task_stamps``); a value that is a list matches by any item.
        """
        return next(self._matches(stamps), None)

    def all_matching(self, stamps: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """Every ``(name, value)`` of a task's stamps that is revoked."""
        return list(self._matches(stamps))

    def _matches(self, stamps: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        if not self._entries:
            return
        for name, value in stamps.items():
            if value is None:
                continue
            for item in value if isinstance(value, list | tuple) else (value,):
                try:
                    if (name, item) in self._entries:
                        yield name, item
                except TypeError:  # a map as a stamp's value: never one of the revoked scalars
                    continue
