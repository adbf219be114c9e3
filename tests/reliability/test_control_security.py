"""S1–S3: who may command workers. Signed commands, the sender allow-list, and least-privilege users.

S2's spoof and S3 run on the session broker (a vhost of their own); S1 creates users, so it runs on a
private node (tests/infra/private_node.py), never on the shared one.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from broker_svc import App, Settings
from broker_svc.schedules.client import ScheduleClient
from broker_svc.topology import node_queue
from control.blocking.client import ControlClient
from control.protocol.signing import ControlSecurity
from tests.infra.private_node import PrivateNode
from tests.infra.session_broker import SessionBroker
from tests.reliability.journal import report
from tests.support.amqp import channel
from tests.support.beats import new_journal, schedule_env, tick_entry, wait_runs
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

KEY = "s3-test-key-" + uuid.uuid4().hex
PIDBOX = "celery.pidbox"


@pytest.fixture
def queue() -> str:
    return unique_queue("sec")


@pytest.fixture
def vhost(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-sec", fallback=test_vhost_url) as url:
        yield url


def _request(method: str, arguments: dict[str, Any], destination: list[str]) -> bytes:
    body = {
        "method": method,
        "arguments": arguments,
        "destination": destination,
        "pattern": None,
        "matcher": None,
    }
    return json.dumps(body).encode()


def _signed_headers(security: ControlSecurity, body: bytes) -> dict[str, Any]:
    return security.sign(
        "request",
        exchange=PIDBOX,
        body=body,
        content_type="application/json",
        content_encoding="utf-8",
        headers={"clock": 1},
    )


def _publish(
    url: str, body: bytes, headers: dict[str, Any], *, user_id: str | None = None, times: int = 1
) -> None:
    with channel(url) as ch:
        properties = pika.BasicProperties(
            content_type="application/json", content_encoding="utf-8", headers=headers, user_id=user_id
        )
        for _ in range(times):  # back to back on one channel: they arrive together
            ch.basic_publish(PIDBOX, "", body, properties)
        ch.confirm_delivery()  # a round trip: everything above has reached the broker


def _refusals(worker: WorkerProcess) -> list[str]:
    return [e["reason"] for e in worker.events() if e.get("event") == "control_request_refused"]


# -- S3 --------------------------------------------------------------------------------------------


def test_s3_only_validly_signed_shutdown_and_revoke_are_acted_on(vhost: str, queue: str):
    """Unsigned, bad signature, replayed (same nonce; old timestamp) and valid, for revoke and shutdown."""
    good = ControlSecurity(key=KEY)
    forger = ControlSecurity(key="not-the-key")
    old = ControlSecurity(key=KEY, now=lambda: time.time() - 120)
    matrix: dict[str, dict[str, str]] = {"revoke": {}, "shutdown": {}}
    with WorkerProcess(vhost, queues=[queue], concurrency=1, env={"CLOCKWORK_CONTROL_KEY": KEY}) as worker:
        worker.wait_ready()
        dest = [worker.name]

        # revoke: one task id per case, so what was acted on shows in the worker's revoked set.
        ids = {
            case: f"{case}-{uuid.uuid4()}" for case in ("unsigned", "bad_signature", "old_timestamp", "valid")
        }
        bodies = {case: _request("revoke", {"task_id": [i]}, dest) for case, i in ids.items()}
        _publish(vhost, bodies["unsigned"], {"clock": 1})
        _publish(vhost, bodies["bad_signature"], _signed_headers(forger, bodies["bad_signature"]))
        _publish(vhost, bodies["old_timestamp"], _signed_headers(old, bodies["old_timestamp"]))
        valid_headers = _signed_headers(good, bodies["valid"])
        _publish(vhost, bodies["valid"], valid_headers, times=2)  # the second one reuses the nonce
        wait_for(lambda: len(_refusals(worker)) >= 4, timeout_s=15, message="four revoke refusals")
        settings = Settings(broker_url=vhost, control_signing_key=KEY)
        with ControlClient(settings) as client:  # a keyed client: signed request, verified reply
            revoked = set(client.inspect("revoked", destination=dest, timeout_s=10)[worker.name])
        acted = {case: ids[case] in revoked for case in ids}
        received = [e for e in worker.events() if e.get("event") == "revoke_received"]
        assert acted == {"unsigned": False, "bad_signature": False, "old_timestamp": False, "valid": True}
        assert len(received) == 1  # the replay did not act a second time
        assert sorted(_refusals(worker)) == sorted(["unsigned", "bad_signature", "stale", "replayed"])
        matrix["revoke"] = {case: "acted" if hit else "refused" for case, hit in acted.items()}
        matrix["revoke"]["replayed_nonce"] = "refused"

        # A client without the key is refused too (it cannot sign), and gets no reply.
        with ControlClient(Settings(broker_url=vhost)) as unkeyed:
            assert unkeyed.inspect("ping", destination=dest, timeout_s=1).missing == {worker.name}

        # shutdown: every bad one leaves the worker running; the valid one stops it.
        before = len(_refusals(worker))
        shutdown = _request("shutdown", {}, dest)
        _publish(vhost, shutdown, {"clock": 1})
        _publish(vhost, shutdown, _signed_headers(forger, shutdown))
        _publish(vhost, shutdown, _signed_headers(old, shutdown))
        wait_for(
            lambda: len(_refusals(worker)) >= before + 3, timeout_s=15, message="three shutdown refusals"
        )
        with ControlClient(settings) as client:
            assert client.inspect("ping", destination=dest, timeout_s=10) == {worker.name: {"ok": "pong"}}
        assert worker.proc.poll() is None and worker.count("shutdown_requested") == 0
        for case in ("unsigned", "bad_signature", "old_timestamp"):
            matrix["shutdown"][case] = "refused"
        valid_headers = _signed_headers(good, shutdown)
        _publish(vhost, shutdown, valid_headers, times=2)  # the second one is a replay
        assert worker.proc.wait(timeout=60) == 0
        assert worker.count("shutdown_requested") == 1
        matrix["shutdown"]["valid"] = "acted"
        reasons = _refusals(worker)
        replay_seen = "replayed" in reasons[before:]
        matrix["shutdown"]["replayed_nonce"] = "refused" if replay_seen else "not delivered (worker gone)"

        # The same signed shutdown replayed at a restarted worker (its nonce cache is new): stale.
        with WorkerProcess(
            vhost, queues=[queue], concurrency=1, name=worker.name, env={"CLOCKWORK_CONTROL_KEY": KEY}
        ) as again:
            again.wait_ready()
            _publish(vhost, shutdown, valid_headers)
            wait_for(lambda: _refusals(again) == ["stale"], timeout_s=15, message="replay at restart refused")
            assert again.proc.poll() is None and again.count("shutdown_requested") == 0
            matrix["shutdown"]["replayed_after_restart"] = "refused"
            # Two keyed workers mingle: the hello is signed, and so is the reply it gets.
            with WorkerProcess(
                vhost, queues=[queue], concurrency=1, env={"CLOCKWORK_CONTROL_KEY": KEY}
            ) as peer:
                peer.wait_ready()
                assert peer.first("mingle_done")["nodes"] == [again.name]
                assert (
                    peer.count("control_reply_refused") == 0 and again.count("control_request_refused") == 1
                )
    expected = {
        "revoke": {
            "unsigned": "refused",
            "bad_signature": "refused",
            "old_timestamp": "refused",
            "valid": "acted",
            "replayed_nonce": "refused",
        },
    }
    assert matrix["revoke"] == expected["revoke"]
    correct = sum(v in ("refused", "acted") for m in matrix.values() for v in m.values())
    total = sum(len(m) for m in matrix.values())
    report(
        "S3",
        None,
        matrix=matrix,
        correct=correct,
        total=total,
        refusal_reasons=sorted(set(reasons)),
    )


# -- S2 --------------------------------------------------------------------------------------------


def test_s2_the_broker_refuses_a_spoofed_user_id(vhost: str):
    with channel(vhost) as ch:
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish(
                "", "anywhere", _request("shutdown", {}, ["x@y"]), pika.BasicProperties(user_id="admin")
            )  # we are logged in as guest
    assert refused.value.reply_code == 406
    report("S2", None, spoofed_user_id_reply_code=refused.value.reply_code)


# -- S1 (and S2's allow-list): users and permissions on a private node -------------------------------


def documented_permissions() -> dict[str, tuple[str, str, str]]:
    """The ``configure``, ``write`` and ``read`` regexes of each role, as docs/deployment.md
    ("Least-privilege users") sets them: its ``sh`` block run by bash, with a ``rabbitmqctl`` that
    only reports its arguments, so the test uses the very regexes a reader copies."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    block = text.split("## Least-privilege users", 1)[1].split("```sh\n", 1)[1].split("\n```", 1)[0]
    script = "rabbitmqctl() { printf '%s\\037' \"$@\"; printf '\\n'; }\n" + block
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    permissions = {}
    for line in out.splitlines():
        command, flag, vhost, user, configure, write, read = line.split("\x1f")[:-1]
        assert (command, flag, vhost) == ("set_permissions", "-p", "/prod"), line
        permissions[user] = (configure, write, read)
    return permissions


# For the default queue ``celery``, the namespace ``celery`` and the scheduler ``default``.
PERMISSIONS = documented_permissions()


@pytest.fixture
def users_node(private_node: PrivateNode) -> Iterator[dict[str, str]]:
    """A vhost of the private node with one user per role; yields each role's URL (admin: guest)."""
    vhost = f"s1-{uuid.uuid4().hex[:8]}"
    suffix = uuid.uuid4().hex[:6]
    private_node.rabbitmqctl("add_vhost", vhost)
    created: list[str] = []
    try:
        private_node.rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        urls = {"admin": f"amqp://guest:guest@127.0.0.1:{private_node.amqp_port}/{vhost}"}
        for role, (configure, write, read) in PERMISSIONS.items():
            user = f"{role}-{suffix}"
            private_node.rabbitmqctl("add_user", user, f"{role}-pw")
            created.append(user)
            private_node.rabbitmqctl("set_permissions", "-p", vhost, user, configure, write, read)
            urls[role] = f"amqp://{user}:{role}-pw@127.0.0.1:{private_node.amqp_port}/{vhost}"
        yield urls
    finally:
        for user in created:
            private_node.rabbitmqctl("delete_user", user)
        private_node.rabbitmqctl("delete_vhost", vhost)


def test_s1_least_privilege_users_isolate_the_control_exchange(users_node: dict[str, str]):
    figures: dict[str, Any] = {}
    # The producer cannot publish to the control exchange...
    with channel(users_node["producer"]) as ch:
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish(PIDBOX, "", _request("shutdown", {}, []), pika.BasicProperties())
    assert refused.value.reply_code == 403 and "ACCESS_REFUSED" in refused.value.reply_text
    figures["producer_to_control_exchange"] = refused.value.reply_code
    login = {role: url.split("//")[1].split(":")[0] for role, url in users_node.items()}
    env = {"CLOCKWORK_CONTROL_USERS": f"{login['operator']},{login['worker']}"}
    with WorkerProcess(users_node["worker"], queues=["celery"], concurrency=1, env=env) as worker:
        worker.wait_ready()
        # ...but its tasks still go through, to a worker that runs as the worker user.
        app = App("producer", settings=Settings(broker_url=users_node["producer"]))
        try:
            assert (
                app.send_task("tests.integration.e2e_tasks.add", args=(2, 3), queue="celery").get(timeout=30)
                == 5
            )
        finally:
            app.close(timeout=10)
        figures["producer_task_ran"] = True
        # The operator pings; the worker answers (its replies go out as the worker user).
        with ControlClient(Settings(broker_url=users_node["operator"])) as ops:
            assert ops.inspect("ping", destination=[worker.name], timeout_s=10) == {
                worker.name: {"ok": "pong"}
            }
            # ...and revokes durably (the log entry needs the revocation stream).
            assert ops.revoke(str(uuid.uuid4()), reply=True, destination=[worker.name], timeout_s=10).logged
        figures["operator_ping"] = "pong"
        figures["operator_revoke_logged"] = True

        # S2's allow-list. The default exchange reaches any queue by name, and permissions cannot
        # stop a producer that may use it from dropping a request straight into a node's queue:
        # the broker takes it; the allow-list refuses it (no user_id, or one not listed).
        mailbox = node_queue(worker.name).name
        with channel(users_node["producer"]) as ch:
            ch.confirm_delivery()
            shutdown = _request("shutdown", {}, [worker.name])
            ch.basic_publish("", mailbox, shutdown, pika.BasicProperties(content_type="application/json"))
            ch.basic_publish(
                "",
                mailbox,
                shutdown,
                pika.BasicProperties(content_type="application/json", user_id=login["producer"]),
            )
        # An administrator (guest here) is not on the list either.
        _publish(users_node["admin"], shutdown, {"clock": 1}, user_id="guest")
        wait_for(lambda: len(_refusals(worker)) >= 3, timeout_s=15, message="three refusals")
        assert sorted(_refusals(worker)) == ["no_user_id", "user_not_allowed", "user_not_allowed"]
        assert worker.proc.poll() is None and worker.count("shutdown_requested") == 0
        figures["allow_list_refused"] = len(_refusals(worker))
        # Least privilege took nothing the worker needs (streams, mingle, events, replies).
        assert "ACCESS_REFUSED" not in worker.log_text()
        figures["default_exchange_injection_accepted_by_broker"] = True
    report("S1", None, **figures)


def test_s1_least_privilege_users_run_the_scheduler_task_states_and_depends_on(
    users_node: dict[str, str], tmp_path: Path
):
    # The same documented users: the worker runs -B (the scheduler "default") with task_states; the
    # producer sends with task_states and depends_on and reads states; the operator reads and
    # changes the schedule and reads task states. None is refused anything.
    journal = new_journal(tmp_path)
    env = {
        **schedule_env({"tick": tick_entry(journal, "celery")}),
        "CLOCKWORK_TASK_STATES": "1",
    }
    args = ["-B", "--beat-lease", "2"]
    with WorkerProcess(
        users_node["worker"], app="tests.integration.beat_tasks:app", queues=["celery"], concurrency=1,
        env=env, extra_args=args,
    ) as worker:  # fmt: skip
        worker.wait_ready()
        worker.first("beat_leading", timeout_s=30)
        wait_runs(journal, 2)  # the scheduler fires, as the worker user
        producer = App("producer", settings=Settings(broker_url=users_node["producer"], task_states=True))
        try:
            first = producer.send_task("beat.tick", (str(journal),), queue="celery")
            second = producer.enqueue("beat.tick", str(journal), depends_on=[first.id], queue="celery")
            assert first.get(timeout=30) and second.get(timeout=30)  # released by the worker
            assert producer.jobs.status(second.id) == "SUCCESS"
        finally:
            producer.close(timeout=10)
        operator = Settings(broker_url=users_node["operator"])
        schedules = ScheduleClient(operator, "default")
        assert [item.entry.name for item in schedules.list()] == ["tick"]
        leader = schedules.leader()
        assert leader is not None and leader.leader == worker.first("beat_leading")["leader"]
        schedules.pause("tick")
        wait_for(lambda: worker.count("beat_schedule_changed") >= 1, timeout_s=15, message="pause applied")
        readers = App("operator", settings=Settings(broker_url=users_node["operator"], task_states=True))
        try:
            assert [r.state for r in readers.jobs.history(second.id)][-1] == "SUCCESS"
        finally:
            readers.close(timeout=10)
        assert "ACCESS_REFUSED" not in worker.log_text(), worker.log_text()[-3000:]
