"""One of two apps sharing a vhost (tests/integration/test_many_apps.py): its own queue and schedule.

Its namespace comes from ``$CLOCKWORK_APP_NAMESPACE`` (a test sets it, or leaves the two apps in
the legacy namespace). Each task notes in ``$MANY_APPS_NOTES`` which app ran it.
"""

from __future__ import annotations

import time

from broker_svc import App
from tests.integration.many_apps_notes import note_run

app = App(
    "shop",
    task_default_queue="shop",
    beat_schedule={"shop-tick": {"task": "shop.tick", "schedule": 1.0}},
)


@app.task(name="shop.add")
def add(x: int, y: int, delay_s: float = 0.0) -> int:
    time.sleep(delay_s)  # a header task a fault can land in the middle of
    note_run("shop", "shop.add")
    return x + y


@app.task(name="shop.xsum")
def xsum(numbers: list[int]) -> int:
    note_run("shop", "shop.xsum")
    return sum(numbers)


@app.task(name="shop.tick")
def tick(label: str = "configured") -> str:
    note_run("shop", f"shop.tick:{label}")
    return label
