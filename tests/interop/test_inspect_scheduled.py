"""``inspect scheduled`` lists the ETA tasks our own client parked: once across the live workers.

Our client sends an ETA task straight to a delay queue and writes a park record with no worker's
name; one live worker that consumes the task's queue lists it (worker/rules/listers.py). Asked
through our control client and through Celery's ``app.control.inspect()``, every such task is
listed exactly once, still after a worker restarts, and no longer once it came due.

The module has a vhost of its own: the members stream keeps a minute of heartbeats and the
scheduled stream every park of the session, so workers and parks of other tests stay out of it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker_svc import App, Settings
from broker_svc.aio import AsyncApp
from control.blocking.client import ControlClient
from tests.infra.session_broker import SessionBroker
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

pytestmark = [pytest.mark.interop, pytest.mark.timeout(240)]

ADD = "tests.integration.e2e_tasks.add"
STARTED_AT = "tests.integration.e2e_tasks.started_at"


@dataclass
class Fleet:
    """Two workers on one queue, and the client that sends to it."""

    url: str
    queue: str
    client: App
    workers: dict[str, WorkerProcess] = field(default_factory=dict)

    def start(self, name: str) -> WorkerProcess:
        worker = WorkerProcess(self.url, queues=[self.queue], concurrency=1, name=name)
        self.workers[name] = worker
        return worker.wait_ready()

    def listings(self) -> dict[str, list[dict[str, Any]]]:
        """Each live worker's ``scheduled`` reply, by our control client."""
        with ControlClient(Settings(broker_url=self.url)) as control:
            replies = control.broadcast("scheduled", {}, reply=True, timeout_s=5).replies
        return {node: value for reply in replies for node, value in reply.items()}

    def listed_once(self, ids: set[str]) -> dict[str, list[str]] | None:
        """Which node lists which of ``ids``, once every worker answers and each id is listed
        exactly once (None before)."""
        listings = self.listings()
        if set(listings) != set(self.workers):
            return None
        return _once(listings, ids)


def _once(listings: dict[str, list[dict[str, Any]]], ids: set[str]) -> dict[str, list[str]] | None:
    counts = Counter(entry["request"]["id"] for entries in listings.values() for entry in entries)
    if any(counts[task_id] != 1 for task_id in ids):
        return None
    return {
        node: [entry["request"]["id"] for entry in entries if entry["request"]["id"] in ids]
        for node, entries in listings.items()
    }


@pytest.fixture(scope="module")
def fleet(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[Fleet]:
    with session_broker.own_vhost("clockwork-scheduled", fallback=test_vhost_url) as url:
        client = App("scheduled-client", settings=Settings(broker_url=url))
        fleet = Fleet(url, unique_queue("scheduled"), client)
        try:
            for name in (f"sched-a-{uuid.uuid4().hex[:6]}@test", f"sched-b-{uuid.uuid4().hex[:6]}@test"):
                fleet.start(name)
            yield fleet
        finally:
            client.close(timeout=10)
            for worker in fleet.workers.values():
                worker.close()


def send_later(fleet: Fleet, count: int, *, countdown: float = 600) -> set[str]:
    ids = {
        fleet.client.send_task(ADD, (i, i), queue=fleet.queue, countdown=countdown).id for i in range(count)
    }
    fleet.client.flush(timeout=10)
    return ids


def test_each_task_our_client_parked_is_listed_by_exactly_one_live_worker(fleet: Fleet):
    ids = send_later(fleet, 12)
    placed = wait_for(
        lambda: fleet.listed_once(ids), timeout_s=20, message="each parked task listed exactly once"
    )
    assert placed is not None
    assert sorted(i for listed in placed.values() for i in listed) == sorted(ids)
    listings = fleet.listings()
    entry = next(e for entries in listings.values() for e in entries if e["request"]["id"] in ids)
    assert entry["request"]["name"] == ADD and entry["request"]["delivery_info"]["routing_key"] == fleet.queue
    # Listed by the node that answers with it, as Celery's request names its worker.
    for node, entries in listings.items():
        assert all(e["request"]["hostname"] == node for e in entries if e["request"]["id"] in ids)
    with ControlClient(Settings(broker_url=fleet.url)) as control:
        some = next(iter(ids))
        found = control.broadcast("query_task", {"ids": [some]}, reply=True, timeout_s=5).replies
    assert [value[some][0] for reply in found for value in reply.values() if some in value] == ["scheduled"]


def test_celery_inspect_scheduled_lists_each_parked_task_once(fleet: Fleet):
    from celery import Celery

    ids = send_later(fleet, 4)
    wait_for(lambda: fleet.listed_once(ids), timeout_s=20, message="each parked task listed exactly once")
    celery_app = Celery("scheduled-inspect", broker=fleet.url)
    try:
        replies = celery_app.control.inspect(timeout=3).scheduled()
    finally:
        celery_app.close()
    assert replies is not None and set(replies) == set(fleet.workers), replies
    counts = Counter(entry["request"]["id"] for entries in replies.values() for entry in entries)
    assert all(counts[task_id] == 1 for task_id in ids), counts
    entry = next(e for entries in replies.values() for e in entries if e["request"]["id"] in ids)
    assert set(entry) == {"eta", "priority", "request"}


def test_a_task_the_asyncio_client_parked_is_listed_once(fleet: Fleet):
    async def send() -> set[str]:
        async with AsyncApp(fleet.client) as aapp:
            results = [await aapp.send_task(ADD, (i, 1), queue=fleet.queue, countdown=600) for i in range(3)]
        return {r.id for r in results}

    ids = asyncio.run(send())
    wait_for(lambda: fleet.listed_once(ids), timeout_s=20, message="the asyncio client's tasks listed once")


def test_a_parked_task_is_no_longer_listed_once_it_came_due_and_ran(fleet: Fleet):
    result = fleet.client.send_task(STARTED_AT, queue=fleet.queue, countdown=3)
    fleet.client.flush(timeout=10)
    wait_for(lambda: fleet.listed_once({result.id}), timeout_s=10, message="the near task listed once")
    result.get(timeout=20)  # it came due and ran
    listings = fleet.listings()
    assert all(e["request"]["id"] != result.id for entries in listings.values() for e in entries), listings


def test_parked_tasks_stay_listed_exactly_once_across_a_worker_restart(fleet: Fleet):
    ids = send_later(fleet, 12)
    wait_for(lambda: fleet.listed_once(ids), timeout_s=20, message="each parked task listed exactly once")
    name = sorted(fleet.workers)[1]
    fleet.workers.pop(name).close()  # worker-offline: the other takes over its share
    alone = wait_for(
        lambda: fleet.listed_once(ids), timeout_s=20, message="the remaining worker lists every task"
    )
    assert alone is not None and sorted(alone[sorted(fleet.workers)[0]]) == sorted(ids)
    fleet.start(name)  # reads the stream from its start; the share is spread again
    wait_for(lambda: fleet.listed_once(ids), timeout_s=20, message="listed exactly once after the restart")
