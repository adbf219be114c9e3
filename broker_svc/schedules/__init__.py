"""Periodic schedules, pure: when an entry fires, which missed times it fires, and each fire's id.

No I/O and no clock reads: every function takes the time (UTC epoch seconds, as ``time.time()``).
The scheduler runtime (leader, journal, publishing) builds on these.
"""

from __future__ import annotations

from broker_svc.schedules.cron_fields import Cronspec
from broker_svc.schedules.crontab import Crontab, crontab
from broker_svc.schedules.due import FIRE_ID_NAMESPACE, MAX_CATCH_UP, due_times, fire_id, next_due
from broker_svc.schedules.entry import DEFAULT_CATCH_UP_WINDOW_S, CatchUp, Entry, Overlap, parse_beat_schedule
from broker_svc.schedules.interval import Every
from broker_svc.schedules.schedule import Schedule, schedule_from_json

__all__ = [
    # schedules: when an entry fires
    "Crontab",
    "Cronspec",
    "Every",
    "Schedule",
    "crontab",
    "schedule_from_json",
    # entries: what fires, and Celery's beat_schedule
    "CatchUp",
    "DEFAULT_CATCH_UP_WINDOW_S",
    "Entry",
    "Overlap",
    "parse_beat_schedule",
    # firing: what is due now, when next, under which task id
    "FIRE_ID_NAMESPACE",
    "MAX_CATCH_UP",
    "due_times",
    "fire_id",
    "next_due",
]
