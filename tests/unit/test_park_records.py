"""Park records: the client writes one for each task it parks, and one live worker lists it."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from broker_svc.clock import LamportClock
from broker_svc.connection.pending import PendingPublish, prepare_publish
from broker_svc.errors import MessageError
from broker_svc.sending.park_records import park_records
from broker_svc.settings import Settings
from broker_svc.topology import scheduled_stream
from broker_svc.wire.records.parked import Parked, parked_record
from broker_svc.wire.task.task_message import TaskMessage
from worker.remote.queue_members import QueueMembership
from worker.rules.listers import QUEUES_FIELD, lister_of

NOW = 1_800_000_000.0


def message(eta_in_s: float | None) -> TaskMessage:
    eta = None if eta_in_s is None else dt.datetime.fromtimestamp(NOW + eta_in_s, dt.UTC)
    return TaskMessage(id=TaskMessage.new_id(), task="add", args=[1, 2], eta=eta, priority=3)


def sent(msg: TaskMessage, *, exchange: str | None = None) -> tuple[PendingPublish, TaskMessage]:
    pending = prepare_publish(
        msg, settings=Settings(), clock=LamportClock(), queue="celery", exchange=exchange
    )
    return pending, msg


def test_a_client_record_names_no_worker_and_its_queue_and_reads_back():
    msg = message(600)
    body = parked_record(msg, hostname=None, delivery_info={"routing_key": "celery"}, queue="celery")
    parked = Parked.decode(body)
    assert (parked.task_id, parked.hostname, parked.queue, parked.priority) == (msg.id, None, "celery", 3)
    assert parked.eta == pytest.approx(NOW + 600)
    reply = parked.reply("w1@host")
    assert reply["request"]["hostname"] == "w1@host" and reply["request"]["args"] == [1, 2]
    assert dt.datetime.fromisoformat(reply["eta"]).timestamp() == pytest.approx(NOW + 600)


def test_a_worker_record_reads_back_as_its_own():
    body = parked_record(message(60), hostname="w1@host", delivery_info={})
    parked = Parked.decode(body)
    assert parked.hostname == "w1@host" and parked.queue is None
    assert parked.reply("w1@host")["request"]["hostname"] == "w1@host"


def test_a_record_without_a_hostname_field_is_refused():
    with pytest.raises(MessageError):
        Parked.decode(json.dumps({"id": "x", "eta": 1.0, "info": {}}).encode())


def test_the_client_records_only_the_tasks_it_sends_to_a_delay_queue():
    far, near, undated = message(600), message(0.05), message(None)
    items = [sent(far), sent(near), sent(undated), sent(message(600), exchange="topic")]
    records = park_records(items, namespace="shop", now=NOW)
    assert len(records) == 1
    [record] = records
    assert record.best_effort and not record.mandatory and record.declare == ()
    assert record.routing_key == scheduled_stream("shop").name
    parked = Parked.decode(record.message.body)
    assert (parked.task_id, parked.hostname, parked.queue) == (far.id, None, "celery")


def test_a_best_effort_record_stays_one_when_sent_again():
    [record] = park_records([sent(message(600))], namespace="celery", now=NOW)
    assert record.copy(resent=True).best_effort


def test_exactly_one_consumer_of_the_queue_lists_each_task():
    members = {"a@h": {"celery"}, "b@h": {"celery", "mail"}, "c@h": {"mail"}}
    listers = [lister_of(f"task-{i}", "celery", members) for i in range(200)]
    assert set(listers) == {"a@h", "b@h"}  # c@h does not consume the queue
    assert lister_of("task-0", "reports", members) is None  # nobody consumes it: nobody lists it


def test_a_worker_that_joins_takes_only_tasks_from_the_others():
    before = {"a@h": {"q"}, "b@h": {"q"}}
    after = {**before, "c@h": {"q"}}
    for i in range(200):
        old, new = lister_of(f"t{i}", "q", before), lister_of(f"t{i}", "q", after)
        assert new in (old, "c@h")


def test_the_membership_keeps_each_live_workers_queues():
    members = QueueMembership()
    members.feed({"type": "worker-heartbeat", "hostname": "a@h", "timestamp": NOW, QUEUES_FIELD: ["q"]})
    members.feed({"type": "worker-heartbeat", "hostname": "b@h", "timestamp": NOW, "freq": 2.0})
    members.feed({"type": "worker-offline", "hostname": "c@h", "timestamp": NOW, QUEUES_FIELD: ["q"]})
    assert members.consumers(NOW + 1) == {"a@h": frozenset({"q"}), "b@h": frozenset()}
    assert members.consumers(NOW + 10) == {}  # silent for two heartbeats: gone


def test_a_due_client_record_is_left_out_when_the_clock_has_passed_it():
    assert park_records([sent(message(600))], namespace="celery", now=NOW + 600) == []
