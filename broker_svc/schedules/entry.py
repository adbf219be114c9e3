"""``Entry``: one periodic task (what, when, how missed times catch up), and Celery's ``beat_schedule``."""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

from broker_svc.schedules.crontab import Crontab
from broker_svc.schedules.interval import Every
from broker_svc.schedules.schedule import RELATIVE_REFUSED, as_schedule, schedule_from_json
from broker_svc.schedules.wall_clock import load_zone
from broker_svc.tasks.request import SEND_OPTIONS

__all__ = ["CatchUp", "DEFAULT_CATCH_UP_WINDOW_S", "Entry", "Overlap", "parse_beat_schedule"]

CatchUp = Literal["skip", "once", "all"]
Overlap = Literal["allow", "skip"]

# How far back catch_up="all" fires missed times when the entry names no window: one day.
DEFAULT_CATCH_UP_WINDOW_S: Final = 86_400.0

_JSON_KEYS = frozenset(
    {"name", "task", "schedule", "args", "kwargs", "options",
     "catch_up", "catch_up_window_s", "overlap", "paused"}
)  # fmt: skip
# A beat_schedule entry's keys: Celery's, then ours.
_BEAT_KEYS = frozenset(
    {"task", "schedule", "args", "kwargs", "options", "relative",
     "catch_up", "catch_up_window", "overlap", "paused"}
)  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One periodic task: the task's name and arguments, its schedule, and its policies.

    Attributes:
        name: the entry's name, unique in a schedule (the key of ``beat_schedule``).
        task: the task's registered name (``"tasks.add"``).
        schedule: when it fires.
        args, kwargs: the task's arguments (a list given for ``args`` is kept as a tuple).
        options: Celery's ``apply_async`` options (queue, routing_key, exchange, priority,
            expires, headers, ...), but not ``dedup_key``/``dedup_timeout``.
        catch_up: what to fire for times missed while no scheduler ran: ``"skip"`` none,
            ``"once"`` the latest one, ``"all"`` every one inside ``catch_up_window_s``.
        catch_up_window_s: for ``"all"``, how far back missed times are fired; None is one day.
        overlap: ``"skip"`` not to fire while the previous fire is still running; ``"allow"`` fires anyway.
        paused: a paused entry fires nothing.

    Raises:
        ValueError: a field out of its vocabulary or range; the message names the field and the fix.
        TypeError: a field of the wrong type.
    """

    name: str
    task: str
    schedule: Every | Crontab
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    catch_up: CatchUp = "once"
    catch_up_window_s: float | None = None
    overlap: Overlap = "allow"
    paused: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an entry's name must be a non-empty string, not {self.name!r}")
        where = f"entry {self.name!r}"
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"{where}: task must be the task's registered name, such as 'tasks.add'")
        if not isinstance(self.schedule, Every | Crontab):
            raise TypeError(
                f"{where}: schedule must be an Every or a Crontab, not {self.schedule!r}; "
                "parse_beat_schedule converts timedeltas, seconds and Celery's schedules"
            )
        if isinstance(self.args, list):
            object.__setattr__(self, "args", tuple(self.args))
        if not isinstance(self.args, tuple):
            raise TypeError(f"{where}: args must be a tuple or a list, not {self.args!r}")
        for label, mapping in (("kwargs", self.kwargs), ("options", self.options)):
            if not isinstance(mapping, dict) or not all(isinstance(key, str) for key in mapping):
                raise TypeError(f"{where}: {label} must be a dict with string keys, not {mapping!r}")
        unknown = set(self.options) - SEND_OPTIONS
        if unknown:
            known = sorted(SEND_OPTIONS)
            raise ValueError(f"{where}: unknown option(s) {sorted(unknown)}; apply_async takes {known}")
        if "dedup_key" in self.options or "dedup_timeout" in self.options:
            # The scheduler fires through its term's exchange; a dedup key sends to a queue.
            raise ValueError(
                f"{where}: a beat entry cannot take dedup_key or dedup_timeout (the scheduler fires "
                "through an exchange, the gate takes tasks sent to a queue); overlap='skip' keeps "
                "an entry to one run at a time"
            )
        self._check_policies(where)

    def _check_policies(self, where: str) -> None:
        if self.catch_up not in get_args(CatchUp):
            raise ValueError(f"{where}: catch_up must be one of {get_args(CatchUp)}, not {self.catch_up!r}")
        window = self.catch_up_window_s
        if window is not None:
            if isinstance(window, bool) or not isinstance(window, int | float):
                raise TypeError(f"{where}: catch_up_window_s must be a number of seconds, not {window!r}")
            if not math.isfinite(window) or window <= 0:
                raise ValueError(f"{where}: catch_up_window_s must be finite and above 0, not {window!r}")
            if self.catch_up != "all":
                raise ValueError(
                    f"{where}: catch_up_window_s only applies to catch_up='all' (this entry has "
                    f"{self.catch_up!r}); drop the window or set catch_up='all'"
                )
        if self.overlap not in get_args(Overlap):
            raise ValueError(f"{where}: overlap must be one of {get_args(Overlap)}, not {self.overlap!r}")
        if not isinstance(self.paused, bool):
            raise TypeError(f"{where}: paused must be True or False, not {self.paused!r}")

    @property
    def window_s(self) -> float:
        """How far back ``catch_up="all"`` fires missed times: ``catch_up_window_s``, else one day."""
        return DEFAULT_CATCH_UP_WINDOW_S if self.catch_up_window_s is None else float(self.catch_up_window_s)

    def to_json(self) -> dict[str, Any]:
        """The entry as JSON values, for ``Entry.from_json`` (to keep entries added at runtime).

        Raises:
            ValueError: args, kwargs or options hold something JSON cannot carry.
        """
        data = {
            "name": self.name,
            "task": self.task,
            "schedule": self.schedule.to_json(),
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "options": dict(self.options),
            "catch_up": self.catch_up,
            "catch_up_window_s": self.catch_up_window_s,
            "overlap": self.overlap,
            "paused": self.paused,
        }
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"entry {self.name!r} cannot be stored as JSON: {exc}") from exc
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        """The entry ``to_json`` wrote.

        Raises:
            ValueError: missing or unknown keys, or fields ``Entry`` refuses.
            TypeError: fields of the wrong type.
        """
        if not isinstance(data, Mapping) or not {"name", "task", "schedule"} <= set(data) <= _JSON_KEYS:
            raise ValueError(f"not an entry's JSON (keys {sorted(_JSON_KEYS)}; name, task, schedule needed)")
        fields = dict(data)
        fields["schedule"] = schedule_from_json(data["schedule"])
        fields["args"] = tuple(data.get("args", ()))
        return cls(**fields)


def parse_beat_schedule(
    beat_schedule: Mapping[str, Mapping[str, Any]], *, timezone: str | None = None
) -> list[Entry]:
    """Celery's ``beat_schedule`` setting as entries, in its order.

    Each value takes Celery's keys (``task``, ``schedule``, ``args``, ``kwargs``, ``options``,
    ``relative``) and ours (``catch_up``, ``catch_up_window`` as a timedelta or seconds,
    ``overlap``, ``paused``). ``schedule`` is a timedelta, a number of seconds, an ``Every``, a
    ``Crontab``, or Celery's ``crontab`` or ``schedule``.

    Args:
        beat_schedule: entry name to entry.
        timezone: the zone of crontabs that name none (Celery's ``timezone`` setting); None is UTC.

    Raises:
        ValueError: an unknown key (named), ``relative=True``, a missing ``task`` or ``schedule``,
            an unknown timezone, or a value an entry refuses; the message names the entry.
        TypeError: a value of the wrong type.
    """
    load_zone(timezone)  # a bad zone is an error even before a crontab needs it
    if not isinstance(beat_schedule, Mapping):
        raise TypeError(f"beat_schedule must map entry names to entries, not {type(beat_schedule).__name__}")
    return [_entry(name, spec, timezone) for name, spec in beat_schedule.items()]


def _entry(name: str, spec: Mapping[str, Any], timezone: str | None) -> Entry:
    where = f"beat_schedule[{name!r}]"
    if not isinstance(spec, Mapping):
        raise TypeError(f"{where} must be a dict with 'task' and 'schedule', not {spec!r}")
    unknown = sorted(set(spec) - _BEAT_KEYS)
    if unknown:
        misplaced = [key for key in unknown if key in SEND_OPTIONS]
        hint = f" (put {misplaced} in 'options')" if misplaced else ""
        raise ValueError(f"{where}: unknown key(s) {unknown}{hint}; an entry takes {sorted(_BEAT_KEYS)}")
    missing = sorted({"task", "schedule"} - set(spec))
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    if spec.get("relative", False) is not False:
        raise ValueError(f"{where}: {RELATIVE_REFUSED}")
    window = spec.get("catch_up_window")
    kwargs, options = spec.get("kwargs") or {}, spec.get("options") or {}
    try:
        return Entry(
            name=name,
            task=spec["task"],
            schedule=as_schedule(spec["schedule"], timezone=timezone),
            args=spec.get("args") or (),
            kwargs=dict(kwargs) if isinstance(kwargs, Mapping) else kwargs,
            options=dict(options) if isinstance(options, Mapping) else options,
            catch_up=spec.get("catch_up", "once"),
            catch_up_window_s=window.total_seconds() if isinstance(window, dt.timedelta) else window,
            overlap=spec.get("overlap", "allow"),
            paused=spec.get("paused", False),
        )
    except (ValueError, TypeError) as exc:
        reason = str(exc).removeprefix(f"entry {name!r}: ")
        raise type(exc)(f"{where}: {reason}") from exc
