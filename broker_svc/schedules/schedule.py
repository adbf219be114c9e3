"""``Schedule`` (an ``Every`` or a ``Crontab``): read from JSON, or from what a Celery beat entry gives."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, TypeAlias

from broker_svc.schedules.crontab import Crontab
from broker_svc.schedules.interval import Every

__all__ = ["RELATIVE_REFUSED", "Schedule", "as_schedule", "schedule_from_json"]

Schedule: TypeAlias = "Every | Crontab"

_CELERY_CRONTAB_FIELDS = (
    "_orig_minute", "_orig_hour", "_orig_day_of_week", "_orig_day_of_month", "_orig_month_of_year",
)  # fmt: skip

RELATIVE_REFUSED = (
    "relative=True is not supported: intervals here are anchored at the Unix epoch (Every(300) fires "
    "at :00, :05, ...), so every scheduler instance, and the next leader, computes the same instants; "
    "drop 'relative' or set it to False"
)


def schedule_from_json(data: Mapping[str, Any]) -> Every | Crontab:
    """The schedule ``Every.to_json`` or ``Crontab.to_json`` wrote.

    Raises:
        ValueError: not a schedule's JSON, or fields the schedule refuses.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a schedule's JSON is an object with a 'type', not {data!r}")
    kind = data.get("type")
    if kind == "every":
        return Every.from_json(data)
    if kind == "crontab":
        return Crontab.from_json(data)
    raise ValueError(f"unknown schedule type {kind!r}: expected 'every' or 'crontab'")


def as_schedule(value: object, *, timezone: str | None = None) -> Every | Crontab:
    """A beat entry's ``schedule`` as ours.

    Takes a ``timedelta``, a number of seconds, an ``Every``, a ``Crontab``, or Celery's own
    ``crontab`` and ``schedule`` objects (read by their attributes; Celery is not imported).

    Args:
        value: the ``schedule`` value.
        timezone: the zone of a crontab that names none (Celery's ``timezone`` setting).

    Raises:
        ValueError: a schedule we cannot honour (``relative=True``, a solar schedule, a zero or
            negative interval), or bad crontab fields.
        TypeError: a value of another type.
    """
    if isinstance(value, Every):
        return value
    if isinstance(value, Crontab):
        return value if value.timezone is not None or timezone is None else value.with_timezone(timezone)
    if isinstance(value, dt.timedelta):
        return Every(value.total_seconds())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Every(value)
    if all(hasattr(value, name) for name in _CELERY_CRONTAB_FIELDS):  # celery.schedules.crontab
        # Same order as ours; Celery keeps a missing field as '*' and a set as a set.
        return Crontab(*(getattr(value, name) for name in _CELERY_CRONTAB_FIELDS), timezone=timezone)
    if hasattr(value, "run_every"):  # celery.schedules.schedule
        if getattr(value, "relative", False):
            raise ValueError(RELATIVE_REFUSED)
        return as_schedule(value.run_every)
    if hasattr(value, "event") and hasattr(value, "lat"):  # celery.schedules.solar
        raise ValueError("solar schedules are not supported; use a crontab at the time you need")
    raise TypeError(
        f"schedule {value!r} ({type(value).__name__}) is not a timedelta, a number of seconds, "
        "an Every, a crontab, or Celery's crontab or schedule"
    )
