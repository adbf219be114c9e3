"""The scheduler's events reach Celery's own event receiver (what Flower and ``celery events`` use):
its leadership, each fire with its task id, and each schedule change made at runtime."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, Settings
from broker_svc.schedules import fire_id
from tests.support.beats import BeatProcess, new_journal, schedule_env
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue

pytestmark = pytest.mark.interop


class _Receiver:
    """Celery's ``app.events.Receiver`` on a thread, keeping every ``beat-*`` event."""

    def __init__(self, url: str) -> None:
        from celery import Celery

        self.app = Celery("beat-events", broker=url)
        self.events: list[dict[str, Any]] = []
        self._ready = threading.Event()
        self._connection = self.app.connection_for_read()
        self.receiver = self.app.events.Receiver(self._connection, handlers={"*": self._on_event})
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_event(self, event: dict[str, Any]) -> None:
        if str(event.get("type", "")).startswith("beat-"):
            self.events.append(event)

    def _run(self) -> None:
        consume_ready = self.receiver.on_consume_ready

        def on_ready(*args: Any, **kwargs: Any) -> None:  # its queue is bound: no event is missed
            consume_ready(*args, **kwargs)
            self._ready.set()

        self.receiver.on_consume_ready = on_ready
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def wait_ready(self) -> None:
        assert self._ready.wait(20), "the Celery event receiver did not start"

    def of(self, event_type: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["type"] == event_type]

    def close(self) -> None:
        self.receiver.should_stop = True
        self._thread.join(timeout=10)
        self._connection.close()
        self.app.close()


@pytest.fixture
def receiver(test_vhost_url: str) -> Iterator[_Receiver]:
    events = _Receiver(test_vhost_url)
    try:
        events.wait_ready()
        yield events
    finally:
        events.close()


def test_celerys_event_receiver_sees_the_leader_its_fires_and_schedule_changes(
    test_vhost_url: str, receiver: _Receiver, tmp_path: Path
):
    journal = new_journal(tmp_path)
    scheduler = f"s-{uuid.uuid4().hex[:8]}"
    queue = unique_queue("beat-events")  # nobody consumes it: the fires wait there
    entry = {"task": "beat.tick", "schedule": 1.0, "args": [str(journal), 0.0], "options": {"queue": queue}}
    app = App("beat-events-client", settings=Settings(broker_url=test_vhost_url))
    try:
        with BeatProcess(test_vhost_url, scheduler=scheduler, env=schedule_env({"tick": entry})):
            wait_for(
                lambda: len(receiver.of("beat-fired")) >= 2, timeout_s=30, message="two beat-fired events"
            )
            app.control.schedules(scheduler).pause("tick")
            wait_for(
                lambda: receiver.of("beat-schedule-changed"), timeout_s=20, message="beat-schedule-changed"
            )
        wait_for(lambda: receiver.of("beat-stepped-down"), timeout_s=20, message="beat-stepped-down")
    finally:
        app.close()
    [leading] = receiver.of("beat-leading")
    assert leading["scheduler"] == scheduler and leading["hostname"].startswith(f"beat.{scheduler}@")
    fired = receiver.of("beat-fired")
    assert all(event["uuid"] == fire_id("tick", event["scheduled"]) for event in fired)
    assert {event["name"] for event in fired} == {"beat.tick"}
    [changed] = receiver.of("beat-schedule-changed")
    assert (changed["op"], changed["entry"]) == ("pause", "tick")
    assert receiver.of("beat-stepped-down")[0]["graceful"] is True
