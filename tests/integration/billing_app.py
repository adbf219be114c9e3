"""The other of two apps sharing a vhost (tests/integration/test_many_apps.py); see shop_app.py.

Its chord body is declared on a queue of its own, which the joiner must honour.
"""

from __future__ import annotations

import time

from broker_svc import App
from tests.integration.many_apps_notes import note_run

app = App(
    "billing",
    task_default_queue="billing",
    beat_schedule={"billing-tick": {"task": "billing.tick", "schedule": 1.0}},
)


@app.task(name="billing.mul")
def mul(x: int, y: int, delay_s: float = 0.0) -> int:
    time.sleep(delay_s)  # a header task a fault can land in the middle of
    note_run("billing", "billing.mul")
    return x * y


@app.task(name="billing.total", queue="billing-totals")
def total(numbers: list[int]) -> int:
    note_run("billing", "billing.total")
    return sum(numbers)


@app.task(name="billing.tick")
def tick(label: str = "configured") -> str:
    note_run("billing", f"billing.tick:{label}")
    return label
