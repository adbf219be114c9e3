"""Chords whose headers nest chains, groups and chords, as a Celery client builds them.

Each with the body's value Celery 5.7's workers give it (measured on a Celery worker with a Redis
result backend; tests/interop/test_celery_redis_backend.py checks a Celery worker still gives it):
a chain's last value; a group unrolled into the header, its members reversed (Celery's client
pushes them to the front of what is left); an inner chord's body value; a group that ends a
chain as one list.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, chain, chord, group

__all__ = ["nested_chords"]


def nested_chords(client: Celery, queue: str) -> dict[str, tuple[Any, Any]]:
    """Name → (the chord, not sent; the body's value on Celery's workers)."""

    def s(name: str, *args: Any) -> Any:
        return client.signature(f"canvas.{name}", args=args, queue=queue)

    def a1() -> Any:
        return s("add", 1, 0)

    def body() -> Any:
        return s("collect")

    return {
        "chain": (chord([a1(), chain(s("add", 2, 0), s("mul", 10))], body()), [1, 20]),
        "group": (chord([a1(), group(s("add", 2, 0), s("add", 3, 0))], body()), [1, 3, 2]),
        "chord": (chord([a1(), chord([s("add", 2, 0), s("add", 3, 0)], s("xsum"))], body()), [1, 5]),
        "chain-group": (
            chord([a1(), chain(s("add", 2, 0), group(s("add", 100), s("add", 100)))], body()),
            [1, [102, 102]],
        ),
        "chain-chord": (
            chord([a1(), chain(s("add", 2, 0), chord([s("add", 100), s("add", 100)], s("xsum")))], body()),
            [1, 204],
        ),
    }
