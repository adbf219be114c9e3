"""The journal tasks plus the ones the delivery-limit and bad-input tests need.

Importing this module (the worker does, as its app) also plants a spy on ``pickle.loads``: should
anything in the worker ever unpickle, a marker file says so (R20).
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

from broker_svc import Task
from tests.reliability.journal import record_execution
from tests.reliability.journal_tasks import app

__all__ = ["PICKLE_SPY_ENV", "app"]

PICKLE_SPY_ENV = "CLOCKWORK_PICKLE_SPY"

_real_loads = pickle.loads


def _spy_loads(data: Any, /, **kwargs: Any) -> Any:
    marker = os.environ.get(PICKLE_SPY_ENV)
    if marker:
        with open(marker, "a") as out:
            out.write(f"pickle.loads called in pid {os.getpid()}\n")
    return _real_loads(data, **kwargs)


pickle.loads = _spy_loads


@app.task(
    bind=True,
    name="journal.always_fails",
    autoretry_for=(ValueError,),
    retry_backoff=0.2,
    retry_jitter=False,
    max_retries=3,
)
def always_fails(self: Task, log_path: str) -> None:
    """Raises every time; autoretry with an exponential backoff of 0.2, 0.4, 0.8 s (R23)."""
    record_execution(self.request.id, self.request.delivery_info)
    with open(log_path, "a") as out:
        out.write(f"{self.request.retries} {time.time()}\n")
    raise ValueError(f"attempt {self.request.retries}")
