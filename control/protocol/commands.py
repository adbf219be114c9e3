"""The command vocabulary (Celery's names, arguments and reply shapes) and a registry of handlers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Final

from broker_svc.logging import get_logger
from control.protocol.request import nok

__all__ = ["COMMANDS", "Command", "CommandKind", "CommandRegistry", "Handler", "Param"]

log = get_logger(__name__)

Handler = Callable[..., Awaitable[Any]]


class CommandKind(StrEnum):
    """``inspect`` commands read; ``control`` commands change the worker."""

    INSPECT = "inspect"
    CONTROL = "control"


@dataclass(frozen=True, slots=True)
class Param:
    """One keyword argument: its accepted types and default (``required`` when it has none)."""

    types: tuple[type, ...]
    default: Any = None
    required: bool = False
    # Turns an accepted value into what the handler takes (Flower's 0/1 for a flag, say).
    coerce: Callable[[Any], Any] | None = None


@dataclass(frozen=True, slots=True)
class Command:
    """A command's name, kind, arguments and what its reply value looks like."""

    name: str
    kind: CommandKind
    params: Mapping[str, Param] = field(default_factory=dict)
    reply: str = ""

    def bind(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``arguments`` against the schema and fill in defaults.

        Raises:
            TypeError: an unknown, missing or wrongly typed argument.
        """
        unknown = set(arguments) - set(self.params)
        if unknown:
            raise TypeError(f"{self.name}() got unexpected argument(s) {sorted(unknown)}")
        bound: dict[str, Any] = {}
        for name, param in self.params.items():
            if name not in arguments:
                if param.required:
                    raise TypeError(f"{self.name}() missing required argument {name!r}")
                bound[name] = param.default
                continue
            value = arguments[name]
            if value is not None and not isinstance(value, param.types):
                wanted = " or ".join(t.__name__ for t in param.types)
                raise TypeError(
                    f"{self.name}() argument {name!r} must be {wanted}, got {type(value).__name__}"
                )
            bound[name] = param.coerce(value) if param.coerce is not None and value is not None else value
        return bound


_STR, _BOOL, _INT, _NUM, _LIST = (str,), (bool,), (int,), (int, float), (list,)
_IDS = (str, list)
# A flag as Celery reads one (``if terminate:``): Flower sends 0 and 1.
_FLAG = (bool, int)
# A signal by name (``SIGKILL``, ``KILL``) or number, as Celery takes it.
_SIGNAL = (str, int)


def _c(name: str, kind: CommandKind, reply: str, **params: Param) -> Command:
    return Command(name, kind, params, reply)


_I, _C = CommandKind.INSPECT, CommandKind.CONTROL

# What Celery 5 workers answer to (WIRE.md §6); pool and rate commands come with load balancing.
COMMANDS: Final[dict[str, Command]] = {
    c.name: c
    for c in (
        _c("ping", _I, '{"ok": "pong"}'),
        _c("clock", _I, '{"clock": n}'),
        _c("hello", _I, '{"revoked": LimitedSet data, "clock": n} or null to itself',
           from_node=Param(_STR, required=True), revoked=Param((dict, list), default={})),
        _c("stats", _I, "map: total, pid, clock (str), uptime, pool, broker, prefetch_count, rusage, "
           "autoscaler (with --autoscale)"),
        _c("active", _I, "list of task info", safe=Param(_BOOL, default=False)),
        _c("reserved", _I, "list of task info"),
        _c("scheduled", _I, "list of {eta, priority, request}"),
        _c("revoked", _I, "list of task ids"),
        _c("registered", _I, "list of task names, each with [item=value ...]",
           taskinfoitems=Param(_LIST, default=None), builtins=Param(_BOOL, default=False)),
        _c("query_task", _I, "{id: [state, task info]}", ids=Param(_IDS, default=[])),
        _c("active_queues", _I, "list of queue maps"),
        _c("conf", _I, "map of settings", with_defaults=Param(_BOOL, default=False)),
        _c("report", _I, '{"ok": "<text: software versions, platform, settings>"}'),
        _c("dedup", _I, "map: active_shards, owned_shards, members, keys, waiting, accepted, blocked, "
           "declined, duplicate, released, evicted, promoted, stale"),
        _c("revoke", _C, '{"ok": "tasks ... flagged as revoked"}', task_id=Param(_IDS, required=True),
           terminate=Param(_FLAG, default=False, coerce=bool), signal=Param(_SIGNAL, default="SIGTERM")),
        _c("revoke_by_stamped_headers", _C, '{"ok": "headers ... flagged as revoked, but not terminated"}',
           headers=Param((dict, list), required=True), terminate=Param(_FLAG, default=False, coerce=bool),
           signal=Param(_SIGNAL, default="SIGTERM")),
        _c("terminate", _C, '{"ok": "terminate: ..."}', task_id=Param(_IDS, required=True),
           signal=Param(_SIGNAL, default="SIGTERM")),
        _c("time_limit", _C, '{"ok": "time limits set successfully"}', task_name=Param(_STR, required=True),
           soft=Param(_NUM, default=None), hard=Param(_NUM, default=None)),
        _c("rate_limit", _C, '{"ok": "new rate limit set successfully"} or "... disabled ..."',
           task_name=Param(_STR, required=True), rate_limit=Param((str, int, float), required=True)),
        _c("pool_grow", _C, '{"ok": "pool will grow"}', n=Param(_INT, default=1)),
        _c("pool_shrink", _C, '{"ok": "pool will shrink"}', n=Param(_INT, default=1)),
        _c("autoscale", _C, '{"ok": "autoscale now max=.. min=.."}', max=Param(_INT, default=None),
           min=Param(_INT, default=None)),
        _c("add_consumer", _C, '{"ok": "add consumer <queue>"}', queue=Param(_STR, required=True),
           exchange=Param(_STR), exchange_type=Param(_STR, default="direct"), routing_key=Param(_STR),
           options=Param((dict,), default=None)),
        _c("cancel_consumer", _C, '{"ok": "no longer consuming from <queue>"}',
           queue=Param(_STR, required=True)),
        _c("enable_events", _C, '{"ok": "task events enabled"}'),
        _c("disable_events", _C, '{"ok": "task events disabled"}'),
        _c("heartbeat", _C, "null (a worker-heartbeat event is sent)"),
        _c("shutdown", _C, "no reply", msg=Param(_STR, default=None)),
    )
}  # fmt: skip


class CommandRegistry:
    """Maps command names to async handlers bound to one worker's state.

    Args:
        commands: the vocabulary to accept (defaults to ``COMMANDS``).
    """

    def __init__(self, commands: Mapping[str, Command] = COMMANDS) -> None:
        self._commands = dict(commands)
        self._handlers: dict[str, Handler] = {}

    def register(self, name: str, handler: Handler) -> None:
        """Attach the handler of a known command.

        Raises:
            KeyError: ``name`` is not in the vocabulary.
        """
        if name not in self._commands:
            raise KeyError(f"unknown command {name!r}; add it to the vocabulary first")
        self._handlers[name] = handler

    def handler(self, name: str) -> Handler:
        """The handler attached to ``name`` (to wrap it before attaching the wrapper instead).

        Raises:
            KeyError: no handler for ``name``.
        """
        return self._handlers[name]

    @property
    def names(self) -> list[str]:
        """Commands that have a handler."""
        return sorted(self._handlers)

    async def dispatch(self, method: str, arguments: Mapping[str, Any]) -> Any:
        """Run a command; unknown names, bad arguments and handler errors become ``{"error": ...}``."""
        command = self._commands.get(method)
        handler = self._handlers.get(method)
        if command is None or handler is None:
            return nok(f"unknown command {method!r}")
        try:
            bound = command.bind(arguments)
        except TypeError as exc:
            return nok(str(exc))
        try:
            return await handler(**bound)
        except Exception as exc:  # typed error reply, never a crash (STYLE rule 24)
            log.exception("control_handler_failed", method=method)
            return nok(f"{type(exc).__name__}: {exc}")
