"""Celery's stamping API: ``sig.stamp(visitor, append_stamps, **headers)`` over a whole canvas.

A stamp is a send option of its own name, listed in the ``stamped_headers`` option, so it travels
in the task message's ``stamped_headers`` and ``stamps`` headers (``broker_svc/wire/task/stamps.py``)
and on every follow-up the worker sends from a stamped signature. Stamping walks a canvas as
Celery 5.7's does, with its merge rules, so a canvas stamped here carries what Celery's would:

- a signature takes the given stamps, its visitor's ``on_signature`` stamps, and keeps its own
  (a new value replaces an old one; ``append_stamps=True`` keeps both, in a list), after stamping
  its callbacks (``on_callback``) and errbacks (``on_errback``) with the given and visitor stamps;
- a chain (``on_chain_start``/``on_chain_end``) and a group (``on_group_start``/``on_group_end``)
  stamp each member and their own links; nothing is set on the chain or group itself;
- a chord stamps its header's members (``on_chord_header_start``/``_end``), and its body only
  when there is a visitor (``on_chord_body``), as Celery's.

The signature classes call in here (``Signature.stamp``); members are stamped through their own
``stamp`` method, so each kind stamps as itself.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["Stampable", "StampingVisitor", "merge_stamps", "stamp", "stamp_links", "stamps_for"]


class StampingVisitor(ABC):
    """Decides the stamps of each part of a canvas (Celery's ``celery.canvas.StampingVisitor``).

    Subclass it and return a map of stamps from each hook; ``on_signature`` is required. Each
    hook gets the part being stamped and the stamps it would get so far.
    """

    def on_group_start(self, group: Any, **headers: Any) -> dict[str, Any]:
        """Stamps for every member of ``group``."""
        return {}

    def on_group_end(self, group: Any, **headers: Any) -> None:  # noqa: B027  # a hook, optional
        """Called once every member of ``group`` is stamped."""

    def on_chain_start(self, chain: Any, **headers: Any) -> dict[str, Any]:
        """Stamps for every step of ``chain``."""
        return {}

    def on_chain_end(self, chain: Any, **headers: Any) -> None:  # noqa: B027  # a hook, optional
        """Called once every step of ``chain`` is stamped."""

    @abstractmethod
    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        """Stamps for one task's signature."""

    def on_chord_header_start(self, sig: Any, **header: Any) -> dict[str, Any]:
        """Stamps for every task of the chord's header: by default its group's ``on_group_start``."""
        return self.on_group_start(sig.kwargs["header"], **header)

    def on_chord_header_end(self, sig: Any, **header: Any) -> None:
        """Called once the chord's header is stamped: by default its group's ``on_group_end``."""
        self.on_group_end(sig.kwargs["header"], **header)

    def on_chord_body(self, sig: Any, **header: Any) -> dict[str, Any]:
        """Stamps for the chord's body."""
        return {}

    def on_callback(self, callback: Any, **header: Any) -> dict[str, Any]:
        """Stamps for a callback (``link``) of the signature being stamped."""
        return {}

    def on_errback(self, errback: Any, **header: Any) -> dict[str, Any]:
        """Stamps for an errback (``link_error``) of the signature being stamped."""
        return {}


class Stampable(Protocol):
    """What stamping reads and sets of a signature (``broker_svc.canvas.signature.Signature``)."""

    @property
    def options(self) -> dict[str, Any]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...
    @property
    def subtask_type(self) -> str | None: ...
    def set(self, immutable: bool | None = None, **options: Any) -> Any: ...
    def stamp(
        self, visitor: StampingVisitor | None = None, append_stamps: bool = False, **headers: Any
    ) -> Any: ...
    def stamp_links(
        self, visitor: StampingVisitor | None = None, append_stamps: bool = False, **headers: Any
    ) -> None: ...


def merge_stamps(into: dict[str, Any], more: Mapping[str, Any] | None, *, aggregate: bool) -> None:
    """Merge ``more`` into ``into`` by Celery's rule (``_merge_dictionaries``).

    A name only ``more`` has is added. For a name both have: maps merge inside; two lists are
    joined; otherwise with ``aggregate`` both values end in one list (``into``'s first), and
    without it ``into``'s value stays.
    """
    if not more:
        return
    for key, value in list(into.items()):
        if key not in more:
            continue
        other = more[key]
        if isinstance(value, dict):
            if isinstance(other, Mapping):
                merge_stamps(value, other, aggregate=aggregate)
            continue
        if isinstance(value, int | float | str) and aggregate:
            into[key] = [value]
        current = into[key]
        if isinstance(other, list) and isinstance(current, list):
            into[key] = [*current, *other]  # a new list: the one in a signature's options stays as it was
        elif aggregate:
            into[key] = [*([] if current is None else list(current)), other]
    for key, value in more.items():
        if key not in into:
            into[key] = value


def stamps_for(
    options: Mapping[str, Any],
    visitor_headers: Mapping[str, Any] | None,
    append_stamps: bool,
    headers: Mapping[str, Any],
    *,
    own: bool = True,
) -> dict[str, Any]:
    """The stamps a part gets (Celery's ``_stamp_headers``), ``stamped_headers`` naming them all.

    ``headers`` first, then the visitor's, then (``own``) the part's own stamps from ``options``;
    merged by ``merge_stamps``, so an earlier value wins unless ``append_stamps`` keeps both.
    """
    stamps = dict(headers)
    stamps.setdefault("stamped_headers", list(headers))
    if visitor_headers is not None:
        visited = dict(visitor_headers)
        visited.setdefault("stamped_headers", list(visitor_headers))
        merge_stamps(stamps, visited, aggregate=append_stamps)
        stamps["stamped_headers"] = _unique(stamps["stamped_headers"])
    if own:
        names = _unique([*stamps.get("stamped_headers", ()), *options.get("stamped_headers", ())])
        stamps["stamped_headers"] = names
        merge_stamps(stamps, {k: v for k, v in options.items() if k in names}, aggregate=append_stamps)
        stamps["stamped_headers"] = _unique(stamps["stamped_headers"])
    return stamps


def stamp(
    sig: Stampable, visitor: StampingVisitor | None, append_stamps: bool, headers: Mapping[str, Any]
) -> None:
    """Stamp ``sig`` and what it holds, as its kind stamps in Celery."""
    kind = sig.subtask_type
    if kind == "chain":
        _stamp_chain(sig, visitor, append_stamps, headers)
    elif kind == "group":
        _stamp_group(sig, visitor, append_stamps, headers)
    elif kind == "chord":
        _stamp_chord(sig, visitor, append_stamps, headers)
    else:
        sig.stamp_links(visitor, append_stamps, **headers)
        visited = None if visitor is None else visitor.on_signature(sig, **headers) or {}
        sig.set(**stamps_for(sig.options, visited, append_stamps, headers))


def stamp_links(
    sig: Stampable,
    links: Iterable[Stampable],
    errbacks: Iterable[Stampable],
    visitor: StampingVisitor | None,
    append_stamps: bool,
    headers: Mapping[str, Any],
) -> None:
    """Stamp ``sig``'s callbacks and errbacks with ``headers`` and the visitor's stamps, not with
    ``sig``'s own; as in Celery, each callback's visitor stamps carry on to the ones after it."""
    for members, hook in ((links, "on_callback"), (errbacks, "on_errback")):
        stamps: dict[str, Any] = copy.deepcopy(dict(headers))
        for link in members:
            visited = None if visitor is None else getattr(visitor, hook)(link, **stamps) or {}
            stamps = stamps_for(sig.options, visited, append_stamps, stamps, own=False)
            link.stamp(visitor, append_stamps, **stamps)


def _stamp_chain(
    sig: Stampable, visitor: StampingVisitor | None, append_stamps: bool, headers: Mapping[str, Any]
) -> None:
    visited = None if visitor is None else visitor.on_chain_start(sig, **headers) or {}
    stamps = stamps_for(sig.options, visited, append_stamps, headers)
    sig.stamp_links(visitor, **stamps)  # Celery's chain stamps its links without append_stamps
    for step in sig.kwargs["tasks"]:
        step.stamp(visitor, append_stamps, **stamps)
    if visitor is not None:
        visitor.on_chain_end(sig, **stamps)


def _stamp_group(
    sig: Stampable, visitor: StampingVisitor | None, append_stamps: bool, headers: Mapping[str, Any]
) -> None:
    visited = None if visitor is None else visitor.on_group_start(sig, **headers) or {}
    stamps = stamps_for(sig.options, visited, append_stamps, headers)
    sig.stamp_links(visitor, append_stamps, **stamps)
    for member in sig.kwargs["tasks"]:
        member.stamp(visitor, append_stamps, **stamps)
    if visitor is not None:
        visitor.on_group_end(sig, **stamps)


def _stamp_chord(
    sig: Stampable, visitor: StampingVisitor | None, append_stamps: bool, headers: Mapping[str, Any]
) -> None:
    visited = None if visitor is None else visitor.on_chord_header_start(sig, **headers) or {}
    stamps = stamps_for(sig.options, visited, append_stamps, headers)
    sig.stamp_links(visitor, append_stamps, **stamps)
    for member in sig.kwargs["header"].kwargs["tasks"]:
        member.stamp(visitor, append_stamps, **stamps)
    body = sig.kwargs.get("body")
    if visitor is not None:
        visitor.on_chord_header_end(sig, **stamps)
        if body is not None:  # Celery stamps a chord's body only through a visitor
            visited = visitor.on_chord_body(sig, **stamps) or {}
            body.stamp(visitor, append_stamps, **stamps_for(sig.options, visited, append_stamps, stamps))


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))
