"""Tasks the keyed-dedup tests run: each run writes when it started and ended, by key."""

from __future__ import annotations

import json
import time

from broker_svc import App

app = App("dedup")


def _note(path: str, **fields: object) -> None:
    with open(path, "a") as out:
        out.write(json.dumps({**fields, "at": time.time()}) + "\n")


@app.task(bind=True)
def refresh(self: object, path: str, key: str, seconds: float = 0.0) -> str:
    """Stand-in for a cache refresh: the journal shows when each run of ``key`` began and ended."""
    task_id = str(self.request.id)  # type: ignore[attr-defined]
    _note(path, event="start", key=key, task_id=task_id)
    time.sleep(seconds)
    _note(path, event="end", key=key, task_id=task_id)
    return task_id


@app.task(bind=True)
def refresh_counted(self: object, path: str, key: str, seconds: float = 0.0) -> dict[str, object]:
    """``refresh`` that also answers how its delivery was marked (a first run: neither)."""
    task_id, info = str(self.request.id), self.request.delivery_info  # type: ignore[attr-defined]
    _note(path, event="start", key=key, task_id=task_id)
    time.sleep(seconds)
    _note(path, event="end", key=key, task_id=task_id)
    return {"id": task_id, "redelivered": info["redelivered"], "delivery_count": info["delivery_count"]}


@app.task(dedup_key="user_id", dedup_timeout=60)
def refresh_user(path: str, user_id: int) -> int:
    _note(path, event="start", key=str(user_id))
    time.sleep(1.0)
    _note(path, event="end", key=str(user_id))
    return user_id
