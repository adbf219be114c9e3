"""A Celery client sends a task that has a dedup key of its own: our worker gates it all the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.infra.session_broker import SessionBroker
from tests.interop.conftest import close_celery_client
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.interop
REFRESH_USER = "tests.integration.dedup_tasks.refresh_user"


def test_a_celery_clients_copies_of_one_key_run_once_and_once_more_and_the_rest_are_revoked(
    session_broker: SessionBroker, tmp_path: Path
):
    from celery import Celery
    from celery.exceptions import TaskRevokedError

    journal = tmp_path / "users.jsonl"
    with session_broker.own_vhost("clockwork-celery-dedup") as url:
        celery = Celery("interop-dedup", broker=url, backend="rpc://")
        try:
            with WorkerProcess(
                url, app="tests.integration.dedup_tasks:app", queues=["users"], concurrency=2
            ) as w:
                w.wait_ready()
                # Celery knows nothing of dedup_key: it publishes straight to the task's queue.
                calls = [
                    celery.send_task(REFRESH_USER, args=(str(journal), 5), queue="users") for _ in range(4)
                ]
                outcomes = []
                for call in calls:  # the children forward them in parallel: any two run
                    try:
                        outcomes.append(call.get(timeout=30))
                    except TaskRevokedError as exc:
                        assert "declined" in str(exc)
                        outcomes.append("declined")
                assert sorted(map(str, outcomes)) == ["5", "5", "declined", "declined"]
                forwarded = {e["task_id"] for e in w.events() if e["event"] == "dedup_forwarded_to_gate"}
                assert forwarded == {call.id for call in calls}  # a resent copy may come twice: one id
        finally:
            close_celery_client(celery)
    runs = [json.loads(line)["event"] for line in journal.read_text().splitlines()]
    assert runs == ["start", "end", "start", "end"]  # one at a time: the second after the first
