"""The task the ordered-queue tests run: it journals its start and end (tests/support/order_journal.py)."""

from __future__ import annotations

import time

from broker_svc import App, Task
from tests.support.order_journal import record

app = App("ordered")


@app.task(bind=True, name="ordered.step")
def step(self: Task, seq: int, journal: str, seconds: float = 0.0) -> int:
    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    node = str(self.request.hostname)
    record(journal, phase="start", seq=seq, node=node, redelivered=redelivered)
    if seconds:
        time.sleep(seconds)
    record(journal, phase="end", seq=seq, node=node, redelivered=redelivered)
    return seq
