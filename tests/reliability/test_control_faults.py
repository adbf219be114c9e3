"""R15–R19: the control plane under faults and bad input.

Revokes that must hold with every worker down or restarted without state (R15, R16: only the
durable revocation log can save them, so each worker gets a fresh, empty state dir), many workers at
once (R17), garbage on the mailbox (R18) and abusive Lamport clocks (R19). The happy paths live in
tests/integration (test_revoke.py, test_mingle.py, test_mailbox.py); these add the fault and the figures.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pika
import pytest

from broker_svc import App, Settings, TaskRevokedError
from broker_svc.clock import MAX_CLOCK
from control.blocking.client import ControlClient
from control.protocol.revoke_log import LOGGED_HEADER
from tests.infra.session_broker import SessionBroker
from tests.reliability.journal import Journal, check, report
from tests.support.amqp import channel
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.reliability.journal_tasks:app"
NOOP = "journal.noop"
PIDBOX = "celery.pidbox"


@pytest.fixture
def vhost(session_broker: SessionBroker, test_vhost_url: str) -> Iterator[str]:
    # Each test its own vhost: its own revocation log and members stream.
    with session_broker.own_vhost("clockwork-ctlfault", fallback=test_vhost_url) as url:
        yield url


def _worker(url: str, queue: str, journal: Journal, state: Path, **kwargs: Any) -> WorkerProcess:
    state.mkdir(parents=True, exist_ok=True)
    assert not any(state.iterdir()), "a fresh worker must start with an empty state dir"
    env = {**journal.env, "CLOCKWORK_STATE_DIR": str(state)}
    return WorkerProcess(url, app=APP, queues=[queue], concurrency=1, env=env, **kwargs)


def _send(app: App, journal: Journal, queue: str, n: int, *, record: bool) -> list[Any]:
    results = []
    for _ in range(n):
        task_id = str(uuid.uuid4())
        results.append(app.send_task(NOOP, queue=queue, task_id=task_id))
        if record:
            journal.published(task_id, confirmed=True)
    return results


def _assert_revoked(results: list[Any]) -> None:
    for result in results:
        with pytest.raises(TaskRevokedError):
            result.get(timeout=60)


# -- R15, R16: revokes that outlive every worker --------------------------------------------------


def test_r15_a_revoke_sent_while_every_worker_is_down_holds(vhost: str, tmp_path: Path):
    queue, journal = unique_queue("r15"), Journal(tmp_path / "journal")
    app = App("r15", settings=Settings(broker_url=vhost))
    try:
        revoked = _send(app, journal, queue, 10, record=False)
        normal = _send(app, journal, queue, 10, record=True)
        app.flush()
        with ControlClient(Settings(broker_url=vhost)) as ctl:  # no worker runs: only the log hears it
            result = ctl.revoke([r.id for r in revoked], timeout_s=0.5)
        assert result.logged
        started = time.monotonic()
        with _worker(vhost, queue, journal, tmp_path / "state") as worker:
            worker.wait_ready()
            journal.wait_executed([r.id for r in normal], timeout_s=60)
            _assert_revoked(revoked)  # every revoked task was received and answered REVOKED
            elapsed = time.monotonic() - started
    finally:
        app.close(timeout=10)
    verdict = check(journal)
    ran = len(journal.executed_ids() & {r.id for r in revoked})
    report("R15", verdict, revoked=10, revoked_ran=ran, seconds_until_done=round(elapsed, 2))
    assert ran == 0 and verdict.lost == 0 and verdict.unexpected == 0


def test_r16_a_revoke_survives_sigkill_of_every_worker_without_state_files(vhost: str, tmp_path: Path):
    queue, journal = unique_queue("r16"), Journal(tmp_path / "journal")
    names = [f"r16-{i}-{uuid.uuid4().hex[:4]}@test" for i in range(2)]
    app = App("r16", settings=Settings(broker_url=vhost))
    try:
        workers = [
            _worker(vhost, queue, journal, tmp_path / f"state-a{i}", name=n) for i, n in enumerate(names)
        ]
        try:
            for worker in workers:
                worker.wait_ready()
            ids = [str(uuid.uuid4()) for _ in range(10)]
            with ControlClient(Settings(broker_url=vhost)) as ctl:
                result = ctl.revoke(ids, reply=True, destination=names, timeout_s=10)
            assert result.logged and result.answered == set(names)
            for worker in workers:  # no graceful stop, so no state file is written either
                worker.kill()
        finally:
            for worker in workers:
                worker.close()
        revoked = [app.send_task(NOOP, queue=queue, task_id=i) for i in ids]
        normal = _send(app, journal, queue, 10, record=True)
        app.flush()
        started = time.monotonic()
        # Restarted under the same names, with fresh state dirs: no file, no peer that remembers.
        workers = [
            _worker(vhost, queue, journal, tmp_path / f"state-b{i}", name=n) for i, n in enumerate(names)
        ]
        try:
            for worker in workers:
                worker.wait_ready()
            journal.wait_executed([r.id for r in normal], timeout_s=60)
            _assert_revoked(revoked)
            elapsed = time.monotonic() - started
            from_log = [w.first("revocation_log_read").get("revoked", 0) for w in workers]
        finally:
            for worker in workers:
                worker.close()
    finally:
        app.close(timeout=10)
    verdict = check(journal)
    ran = len(journal.executed_ids() & set(ids))
    report(
        "R16",
        verdict,
        revoked=10,
        revoked_ran=ran,
        read_from_log=from_log,
        seconds_until_done=round(elapsed, 2),
    )
    assert ran == 0 and verdict.lost == 0 and verdict.unexpected == 0
    assert all(n >= 10 for n in from_log)


# -- R17: many workers at once --------------------------------------------------------------------


def _raw_call(url: str, method: str, arguments: dict[str, Any], destination: list[str]) -> list[bytes]:
    """The raw reply bodies of one request (for their sizes)."""
    bodies: list[bytes] = []
    oid = uuid.uuid4().hex
    with channel(url) as ch:
        reply_queue = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(reply_queue, "reply.celery.pidbox", routing_key=oid)
        request = {
            "method": method, "arguments": arguments, "destination": destination, "pattern": None,
            "matcher": None, "ticket": str(uuid.uuid4()),
            "reply_to": {"exchange": "reply.celery.pidbox", "routing_key": oid},
        }  # fmt: skip
        ch.basic_publish(
            PIDBOX, "", json.dumps(request).encode(), pika.BasicProperties(content_type="application/json")
        )

        def got() -> bool:
            method_frame, _, payload = ch.basic_get(reply_queue, auto_ack=True)
            if method_frame is not None:
                bodies.append(payload)
            return len(bodies) >= len(destination)

        wait_for(got, timeout_s=30, interval_s=0.05, message=f"{method} reply")
    return bodies


@pytest.mark.parametrize(
    "workers", [pytest.param(4, id="w4"), pytest.param(20, id="w20", marks=pytest.mark.chaos)]
)
def test_r17_hello_and_inspect_with_many_workers_started_at_once(vhost: str, tmp_path: Path, workers: int):
    queue, journal = unique_queue("r17"), Journal(tmp_path / "journal")
    procs = [_worker(vhost, queue, journal, tmp_path / f"state{i}") for i in range(workers)]
    try:
        for proc in procs:
            proc.wait_ready(timeout_s=120)
        names = {p.name for p in procs}
        mingles = [p.first("mingle_done") for p in procs]
        latencies: list[float] = []
        answered: list[int] = []
        with ControlClient(Settings(broker_url=vhost)) as ctl:
            # Membership comes from heartbeats in the members stream: wait until it knows them all.
            wait_for(
                lambda: set(ctl.inspect("ping", timeout_s=5)) == names,
                timeout_s=60,
                message="all workers answer",
            )
            for _ in range(20):
                started = time.monotonic()
                replies = ctl.inspect("ping", timeout_s=10)
                latencies.append(time.monotonic() - started)
                answered.append(len(set(replies) & names))
        # The biggest replies a node sends, with 100,000 revoked ids: bounded by the LimitedSet
        # (50,000 for ``revoked``) and by the hello limit (10,000 newest).
        target = procs[0].name
        ids = [f"{i:08d}-{uuid.uuid4().hex[:8]}" for i in range(100_000)]
        for chunk in range(0, len(ids), 10_000):
            call(
                vhost, "revoke", arguments={"task_id": ids[chunk : chunk + 10_000]}, destination=[target],
                headers={LOGGED_HEADER: True}, expect=1, wait_s=30,
            )  # fmt: skip
        revoked_bytes = max(map(len, _raw_call(vhost, "revoked", {}, [target])))
        hello_bytes = max(
            map(len, _raw_call(vhost, "hello", {"from_node": "x@test", "revoked": {}}, [target]))
        )
        alive = sum(p.proc.poll() is None for p in procs)
    finally:
        for proc in procs:
            proc.close()
    ordered = sorted(latencies)
    figures = {
        "workers": workers,
        "completeness_pct": round(100 * sum(answered) / (len(answered) * workers), 1),
        "inspect_p50_ms": round(1000 * statistics.median(ordered), 1),
        "inspect_p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
        "mingle_max_ms": max(m.get("ms", 0) for m in mingles),
        # Started together, most peers' mailboxes are not up yet when a hello goes out: nothing
        # to learn from them then (they have no revokes), and the members stream tells the next one.
        "hello_completeness_pct": round(
            100 * sum(m.get("synced", 0) for m in mingles) / (workers * (workers - 1)), 1
        ),
        "largest_revoked_reply_bytes": revoked_bytes,
        "largest_hello_reply_bytes": hello_bytes,
    }
    report("R17", None, **figures)
    assert figures["completeness_pct"] == 100.0 and alive == workers
    assert revoked_bytes < 4_000_000 and hello_bytes < 1_500_000  # bounded, whatever the revoked count


# -- R18: malformed control messages --------------------------------------------------------------


def test_r18_malformed_commands_never_restart_the_worker(vhost: str, tmp_path: Path):
    # Malformed *replies* to Mingle's hello: tests/integration/test_mingle.py
    # (test_malformed_hello_replies_are_skipped_and_the_worker_starts).
    queue, journal = unique_queue("r18"), Journal(tmp_path / "journal")
    bad_requests: list[tuple[str, bytes, str]] = [
        ("wrong_content_type", b"\x80\x04K\x01.", "application/x-python-serialize"),
        ("garbage_msgpack", b"\xc1\xc1\xc1", "application/x-msgpack"),
        (
            "truncated_msgpack",
            msgpack.packb({"method": "ping", "arguments": {}})[:-3],
            "application/x-msgpack",
        ),
        ("msgpack_ext_type", msgpack.packb(msgpack.ExtType(42, b"boom")), "application/x-msgpack"),
        ("not_a_map", b"[1,2,3]", "application/json"),
        ("oversized", b'{"method":"ping","x":"' + b"x" * (16 * 1024 * 1024) + b'"}', "application/json"),
    ]
    with _worker(vhost, queue, journal, tmp_path / "state") as worker:
        worker.wait_ready()
        pid = worker.pid
        for _, body, content_type in bad_requests:
            assert call(vhost, "ping", body=body, content_type=content_type, wait_s=0.5) == []
        # An unknown command is answered with an error, not a crash.
        [(_, unknown)] = call(vhost, "no_such_command", destination=[worker.name], expect=1)
        assert "error" in unknown[worker.name]
        wait_for(
            lambda: worker.count("control_request_refused") >= len(bad_requests),
            timeout_s=15,
            message="every bad request refused",
        )
        [(_, pong)] = call(vhost, "ping", destination=[worker.name], expect=1)
        restarts = worker.count("worker_ready") - 1
        alive = worker.proc.poll() is None and worker.pid == pid
        ignored = worker.count("control_request_refused")
        # The worker still runs tasks.
        app = App("r18", settings=Settings(broker_url=vhost))
        try:
            task_id = str(uuid.uuid4())
            journal.published(task_id, confirmed=True)
            app.send_task(NOOP, queue=queue, task_id=task_id)
            journal.wait_executed([task_id], timeout_s=30)
        finally:
            app.close(timeout=10)
    report(
        "R18", check(journal), bad_requests=len(bad_requests), ignored=ignored, unknown_command="error reply",
        worker_restarts=restarts,
    )  # fmt: skip
    assert pong == {worker.name: {"ok": "pong"}} and alive and restarts == 0
    assert ignored == len(bad_requests)


# -- R19: Lamport clock abuse ---------------------------------------------------------------------

# pika cannot put 2**64 in an AMQP table at all ("int too large"), so it goes as its decimal
# string; 2**63 - 1 is the largest int an AMQP header can carry.
CLOCK_ABUSE: list[tuple[str, Any]] = [
    ("2^64_as_string", str(2**64)),
    ("2^63-1", 2**63 - 1),
    ("-1", -1),
    ("string", "not-a-clock"),
    ("missing", None),
]


def test_r19_abusive_clocks_leave_the_workers_clock_in_range(vhost: str, tmp_path: Path):
    queue, journal = unique_queue("r19"), Journal(tmp_path / "journal")
    after: dict[str, int] = {}
    with _worker(vhost, queue, journal, tmp_path / "state") as worker:
        worker.wait_ready()
        dest = [worker.name]
        for case, value in CLOCK_ABUSE:
            headers = {} if value is None else {"clock": value}
            with channel(vhost) as ch:  # the "clock" header set (or left out) exactly as the case says
                oid = uuid.uuid4().hex
                reply_queue = ch.queue_declare("", exclusive=True).method.queue
                ch.queue_bind(reply_queue, "reply.celery.pidbox", routing_key=oid)
                request = {
                    "method": "clock", "arguments": {}, "destination": dest, "ticket": str(uuid.uuid4()),
                    "reply_to": {"exchange": "reply.celery.pidbox", "routing_key": oid},
                }  # fmt: skip
                properties = pika.BasicProperties(content_type="application/json", headers=headers)
                ch.basic_publish(PIDBOX, "", json.dumps(request).encode(), properties)
                got: list[Any] = []

                def reply(ch: Any = ch, queue: str = reply_queue, got: list[Any] = got) -> bool:
                    method, props, body = ch.basic_get(queue, auto_ack=True)
                    if method is not None:
                        got.append((props.headers, json.loads(body)))
                    return bool(got)

                wait_for(reply, timeout_s=10, interval_s=0.05, message=f"clock reply ({case})")
            reply_headers, body = got[0]
            clock = body[worker.name]["clock"]
            assert 0 <= clock < 1_000 and 0 <= reply_headers["clock"] <= MAX_CLOCK, (case, clock)
            after[case] = clock
        assert worker.count("control_request_failed") == 0 and worker.proc.poll() is None
    report("R19", None, clock_after=after, max_clock=MAX_CLOCK, exceptions=0)
    assert list(after.values()) == sorted(after.values())  # it only ever moves forward, by small steps
