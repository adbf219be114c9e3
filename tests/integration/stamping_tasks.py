"""Tasks that show their stamps, for the stamping interop tests (tests/interop/test_celery_stamping.py).

tests/interop/celery_app.py defines the same names for a Celery worker.
"""

from __future__ import annotations

import time
from typing import Any

from broker_svc import App

app = App("stamping")
app.conf.update(accept_content=["json", "msgpack"], task_serializer="json")


@app.task(name="stamps.look", bind=True)
def look(self: Any, *parents: Any) -> dict[str, Any]:
    """Its stamps as the task sees them (and its parent step's, when it is a chain's step)."""
    return {
        "stamped_headers": sorted(self.request.stamped_headers or []),
        "stamps": self.request.stamps,
        "parents": list(parents),
    }


@app.task(name="stamps.sleep")
def sleep(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"
