"""``task_routes``: which queue a task goes to, by Celery's rules.

Celery's forms are all taken: a map from task name (exact, glob ``"proj.*"`` or compiled regex) to
a queue name or a dict of options; a router function ``(name, args, kwargs, options, task=None,
**kw)`` returning the same or None; a dotted path to such a function; or a list of these, tried in
order, the first answer winning. Within a map, an exact name wins over a pattern.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from broker_svc.apps.conf import load_object
from broker_svc.errors import ConfigurationError

__all__ = ["ROUTE_OPTIONS", "queue_for", "route_for"]

# What a route may set (docs/migrating-from-celery.md, "task_routes").
ROUTE_OPTIONS: Final = frozenset({"queue", "exchange", "routing_key", "priority", "serializer"})


def route_for(
    routes: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
) -> dict[str, Any]:
    """The options ``routes`` give task ``name`` (``{}`` when none matches).

    Raises:
        ConfigurationError: a route of an unknown form, or a routing key that contradicts its queue.
    """
    if routes is None:
        return {}
    for router in routes if isinstance(routes, list | tuple) else (routes,):
        found = _ask(router, name, args, kwargs, options)
        if found is not None:
            return _checked(found, name)
    return {}


def queue_for(
    routes: Any,
    name: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
    *,
    declared: str | None,
    default: str,
) -> tuple[str, dict[str, Any]]:
    """The queue a task goes to by Celery's order, and the route that named it (``{}`` if none did):
    the ``queue`` option, else the queue its task is ``declared`` with (``@app.task(queue=...)``),
    else ``routes``, else ``default``. A route through another exchange gives no queue: the route
    says where it goes, and the queue returned is ``default``.

    Raises:
        ConfigurationError: as ``route_for``.
    """
    explicit = options.get("queue")
    if isinstance(explicit, str) and explicit:
        return explicit, {}
    if declared:
        return declared, {}
    routed = route_for(routes, name, args, kwargs, options)
    return routed.get("queue") or default, routed


def _ask(
    router: Any, name: str, args: Sequence[Any], kwargs: Mapping[str, Any], options: Mapping[str, Any]
) -> Any:
    if isinstance(router, str):
        router = load_object(router)
    if isinstance(router, Mapping):
        return _from_map(router, name)
    if callable(router):
        answer: Callable[..., Any] = router
        return answer(name, args, kwargs, options, task=None)
    raise ConfigurationError(f"task_routes: {router!r} is not a map, a router function or a dotted path")


def _from_map(routes: Mapping[Any, Any], name: str) -> Any:
    if name in routes:
        return routes[name]
    for pattern, target in routes.items():
        if isinstance(pattern, re.Pattern):
            if pattern.match(name):
                return target
        elif isinstance(pattern, str) and any(c in pattern for c in "*?["):
            if fnmatch.fnmatchcase(name, pattern):
                return target
    return None


def _checked(found: Any, name: str) -> dict[str, Any]:
    route = {"queue": found} if isinstance(found, str) else found
    if not isinstance(route, Mapping):
        raise ConfigurationError(f"task_routes gave {found!r} for {name!r}: expected a queue name or a dict")
    result = dict(route)
    queue = result.get("queue")
    if isinstance(queue, Mapping):  # Celery also takes {"queue": {"name": ...}} style entries
        queue = queue.get("name")
    exchange = result.pop("exchange", None)
    routing_key = result.pop("routing_key", None)
    if exchange and (exchange != queue or routing_key not in (None, queue)):
        # Another exchange (a topic route, say): published there with the routing key, as Celery.
        if not isinstance(exchange, str):
            raise ConfigurationError(f"task_routes for {name!r}: exchange must be a name, got {exchange!r}")
        result["exchange"] = exchange
        result["routing_key"] = routing_key if routing_key is not None else (queue or "")
        result.pop("queue", None)
        queue = None
    elif queue is None and routing_key is not None:
        queue = routing_key  # the default exchange routes by queue name
    elif routing_key not in (None, queue):
        raise ConfigurationError(
            f"task_routes for {name!r} names routing_key {routing_key!r} for queue {queue!r}: on the default "
            "exchange the routing key is the queue's name"
        )
    if queue is not None:
        result["queue"] = queue
    unknown = set(result) - ROUTE_OPTIONS
    if unknown:
        raise ConfigurationError(
            f"task_routes for {name!r} sets {sorted(unknown)}; known: {sorted(ROUTE_OPTIONS)}"
        )
    return result
