"""R12–R14, R24, R25 and failover: the client's connection under broker faults, on private nodes.

Every test here breaks or reconfigures a broker, so each uses a private node (never the shared
one): resource alarms (R12 memory, R13 disk), a broker that is down at start or restarts its app
mid-run (R14), a broker ``max_message_size`` (R24), a queue deleted under a publisher (R25), and a
failover list whose first broker is down.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from broker_svc import App, BrokerBlocked, LamportClock, MessageTooLarge, Publisher, Settings, TaskMessage
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import BrokerSvcError, Unroutable
from tests.infra.node_setup import find_free_amqp_port
from tests.infra.private_node import PrivateNode
from tests.reliability.journal import report
from tests.support.amqp import delete_queues, drain, queue_depth
from tests.support.cli import run_ctl
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

CONFIRM_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def node() -> Iterator[PrivateNode]:
    with PrivateNode.started() as broker:
        yield broker


def _message(n: int, size: int = 0) -> TaskMessage:
    return TaskMessage(id=str(uuid.uuid4()), task="t.x", args=[n, "x" * size], ignore_result=True)


def _ids_in(url: str, queue: str) -> list[str]:
    return [str(m.headers.get("id")) for m in drain(url, queue)]


# -- R12 / R13: resource alarms ------------------------------------------------------------------

ALARMS = {
    "memory": (("set_vm_memory_high_watermark", "0.00001"), ("set_vm_memory_high_watermark", "0.4")),
    "disk": (("set_disk_free_limit", "100000GB"), ("set_disk_free_limit", "50MB")),
}


def _alarms(node: PrivateNode) -> str:
    return node.rabbitmqctl("eval", "rabbit_alarm:get_alarms().")


@pytest.mark.parametrize(("row", "alarm"), [("R12", "memory"), ("R13", "disk")])
def test_publishing_under_an_alarm_fails_typed_in_time_and_resumes_after_it(node: PrivateNode, row, alarm):
    raise_alarm, clear_alarm = ALARMS[alarm]
    queue = unique_queue(alarm)
    settings = Settings(broker_url=node.url, confirm="each", confirm_timeout_s=CONFIRM_TIMEOUT_S)
    app = App("alarm", settings=settings)
    confirmed: list[str] = []
    failed: list[str] = []
    call_s: list[float] = []

    def send(n: int) -> BrokerSvcError | None:
        task_id = str(uuid.uuid4())
        started = time.monotonic()
        try:
            app.send_task("t.x", (n,), queue=queue, task_id=task_id, ignore_result=True)
        except BrokerSvcError as exc:
            failed.append(task_id)
            return exc
        finally:
            call_s.append(time.monotonic() - started)
        confirmed.append(task_id)
        return None

    try:
        for n in range(20):
            assert send(n) is None
        node.rabbitmqctl(*raise_alarm)
        wait_for(lambda: alarm in _alarms(node), timeout_s=30, message=f"no {alarm} alarm")
        errors = [send(100 + n) for n in range(4)]
        alarm_max_call_s = max(call_s[20:])
        node.rabbitmqctl(*clear_alarm)
        wait_for(lambda: alarm not in _alarms(node), timeout_s=30, message=f"the {alarm} alarm stayed")
        # The same client publishes again, without a restart.
        for n in range(20):
            assert send(200 + n) is None
    finally:
        node.rabbitmqctl(*clear_alarm)
        app.close(timeout=10)
    in_queue = _ids_in(node.url, queue)
    failed_but_enqueued = len(set(failed) & set(in_queue))
    report(
        row,
        None,
        alarm=alarm,
        publish_errors=len(failed),
        error_types=sorted({type(e).__name__ for e in errors if e is not None}),
        failed_but_enqueued=failed_but_enqueued,
        max_call_s_during_alarm=round(alarm_max_call_s, 2),
        confirm_timeout_s=CONFIRM_TIMEOUT_S,
        confirmed=len(confirmed),
        lost_confirmed=len(set(confirmed) - set(in_queue)),
    )
    assert all(isinstance(e, BrokerBlocked) for e in errors), errors
    assert alarm_max_call_s < CONFIRM_TIMEOUT_S + 2.0
    assert len(confirmed) == 40 and set(confirmed) <= set(in_queue)


# -- R14: a broker down at start, and an app restart mid-run ---------------------------------------


def test_client_and_worker_started_before_the_broker_connect_once_it_is_up():
    broker = PrivateNode.create()
    queue = unique_queue("early")
    app = App("early", settings=Settings(broker_url=broker.url, reconnect_window_s=120))
    try:
        with WorkerProcess(broker.url, queues=[queue], concurrency=2) as worker:
            results = [
                app.send_task("tests.integration.e2e_tasks.add", (n, 1), queue=queue) for n in range(50)
            ]
            wait_for(
                lambda: worker.count("broker_connect_failed") >= 2,
                timeout_s=30,
                message=f"the worker did not retry:\n{worker.log_text()[-2000:]}",
            )
            assert worker.proc.poll() is None  # waiting, not crashed
            broker.start()
            up_at = time.monotonic()
            app.flush(timeout=60)
            connected_s = time.monotonic() - up_at
            worker.wait_ready(timeout_s=60)
            ready_s = time.monotonic() - up_at
            assert [r.get(timeout=60) for r in results] == [n + 1 for n in range(50)]
    finally:
        app.close(timeout=10)
        broker.stop()
    report("R14", None, case="broker down at start", lost=0, client_connected_s=round(connected_s, 2),
           worker_ready_s=round(ready_s, 2), tasks=50)  # fmt: skip


def test_stop_app_and_start_app_mid_run_lose_no_confirmed_publish(node: PrivateNode):
    queue = unique_queue("restart")
    publisher = Publisher(Settings(broker_url=node.url, publish_attempts=5), clock=LamportClock())
    sent: list[PendingPublish] = []
    restarted = threading.Event()

    def produce() -> None:
        for n in range(2000):
            sent.append(publisher.send(_message(n), queue=queue))
            if n == 500:
                restarted.wait(60)  # the rest goes out around the restart

    producer = threading.Thread(target=produce)
    try:
        producer.start()
        wait_for(lambda: len(sent) > 500, timeout_s=30, message="nothing sent")
        node.rabbitmqctl("stop_app")
        down_at = time.monotonic()
        restarted.set()
        node.rabbitmqctl("start_app")
        producer.join(60)
        publisher.flush(timeout=90)
        recovered_s = time.monotonic() - down_at
    finally:
        restarted.set()
        try:
            publisher.close(timeout=5)
        except BrokerSvcError:
            pass
    confirmed = {p.message.headers["id"] for p in sent if p.done and p.error is None}
    in_queue = _ids_in(node.url, queue)
    lost = len(confirmed - set(in_queue))
    duplicates = len(in_queue) - len(set(in_queue))
    report("R14", None, case="stop_app/start_app mid-run", published=len(sent), confirmed=len(confirmed),
           lost=lost, duplicates=duplicates, recovery_s=round(recovered_s, 2))  # fmt: skip
    assert len(confirmed) == 2000 and lost == 0


# -- R24: oversized messages -----------------------------------------------------------------------


def test_a_body_over_the_client_limit_is_refused_before_publishing(node: PrivateNode):
    queue = unique_queue("big")
    app = App("big", settings=Settings(broker_url=node.url, max_body_bytes=1024 * 1024))
    try:
        with pytest.raises(MessageTooLarge):
            app.send_task("t.x", ("x" * 2 * 1024 * 1024,), queue=queue)
        app.send_task("t.x", ("small",), queue=queue, ignore_result=True)
        app.flush(timeout=10)
    finally:
        app.close(timeout=5)
    assert queue_depth(node.url, queue) == 1  # only the small one went out
    report("R24", None, case="client limit", error_type="MessageTooLarge", sent_before_refusal=0)


def test_a_broker_max_message_size_refusal_loses_no_other_publish(node: PrivateNode):
    queue = unique_queue("cap")
    node.rabbitmqctl("eval", "application:set_env(rabbit, max_message_size, 1048576).")
    publisher = Publisher(Settings(broker_url=node.url), clock=LamportClock())
    try:
        small = [publisher.send(_message(n), queue=queue) for n in range(300)]
        big = publisher.send(_message(-1, size=2 * 1024 * 1024), queue=queue)
        small += [publisher.send(_message(n), queue=queue) for n in range(300, 600)]
        for pending in [*small, big]:
            assert pending.wait(60)
    finally:
        node.rabbitmqctl("eval", "application:set_env(rabbit, max_message_size, 134217728).")
        try:
            publisher.close(timeout=5)
        except BrokerSvcError:
            pass  # the big one is reported again
    in_queue = _ids_in(node.url, queue)
    small_ids = {p.message.headers["id"] for p in small}
    collateral = [p for p in small if p.error is not None]
    report("R24", None, case="broker max_message_size", error_type=type(big.error).__name__,
           collateral_failures=len(collateral), collateral_lost=len(small_ids - set(in_queue)),
           duplicates=len(in_queue) - len(set(in_queue)))  # fmt: skip
    assert isinstance(big.error, MessageTooLarge), big.error
    assert collateral == [] and small_ids <= set(in_queue)


# -- R25: unroutable -------------------------------------------------------------------------------


def test_a_publish_to_a_queue_deleted_meanwhile_raises_unroutable_then_recovers(node: PrivateNode):
    queue = unique_queue("gone")
    publisher = Publisher(Settings(broker_url=node.url, confirm="each"), clock=LamportClock())
    try:
        publisher.send(_message(1), queue=queue)
        delete_queues(node.url, queue)
        with pytest.raises(Unroutable):
            publisher.send(_message(2), queue=queue)
        publisher.send(_message(3), queue=queue)  # declared again, delivered
    finally:
        publisher.close(timeout=5)
    assert queue_depth(node.url, queue) == 1
    report("R25", None, raised=True, error_type="Unroutable", recovered=True)


# -- failover --------------------------------------------------------------------------------------


def test_a_failover_list_skips_a_dead_broker_for_client_and_worker(node: PrivateNode):
    dead = f"amqp://guest:guest@127.0.0.1:{find_free_amqp_port()}/"
    url = f"{dead};{node.url}"
    queue = unique_queue("failover")
    app = App("failover", settings=Settings(broker_url=url))
    try:
        with WorkerProcess(url, queues=[queue], concurrency=1) as worker:
            worker.wait_ready(timeout_s=60)
            started = time.monotonic()
            assert app.send_task("tests.integration.e2e_tasks.add", (1, 2), queue=queue).get(timeout=30) == 3
            took = time.monotonic() - started
            ping, _ = run_ctl("inspect", "ping", "-b", url, "-d", worker.name, "--timeout", "10")
            assert ping.returncode == 0 and "pong" in ping.stdout, ping.stderr
    finally:
        app.close(timeout=5)
    report("R14", None, case="failover list, first broker down", task_s=round(took, 2), ctl_ping=True)


@pytest.fixture
def second_node() -> Iterator[PrivateNode]:
    with PrivateNode.started() as broker:
        yield broker


def test_a_frozen_broker_times_out_confirms_and_the_client_fails_over_with_the_same_ids(
    node: PrivateNode, second_node: PrivateNode
):
    """The first broker freezes (SIGSTOP): unconfirmed publishes time out, go to the second one."""
    queue = unique_queue("frozen")
    settings = Settings(broker_url=f"{node.url};{second_node.url}", confirm_timeout_s=CONFIRM_TIMEOUT_S)
    publisher = Publisher(settings, clock=LamportClock())
    pid = node.pid()
    assert pid is not None
    sent = [publisher.send(_message(n), queue=queue) for n in range(300)]
    publisher.flush(timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        sent += [publisher.send(_message(n), queue=queue) for n in range(300, 600)]
        publisher.flush(timeout=60)
        failover_s = time.monotonic() - frozen_at
    finally:
        os.kill(pid, signal.SIGCONT)
        try:
            publisher.close(timeout=10)
        except BrokerSvcError:
            pass
    confirmed = {p.message.headers["id"] for p in sent if p.error is None and p.done}
    on_first, on_second = _ids_in(node.url, queue), _ids_in(second_node.url, queue)
    everywhere = on_first + on_second
    lost = len(confirmed - set(everywhere))
    report("R14", None, case="failover after a frozen broker (confirm timeout)", confirmed=len(confirmed),
           lost=lost, duplicates=len(everywhere) - len(set(everywhere)), on_second=len(set(on_second)),
           failover_s=round(failover_s, 2), confirm_timeout_s=CONFIRM_TIMEOUT_S)  # fmt: skip
    assert len(confirmed) == 600 and lost == 0
    assert set(on_second) >= {p.message.headers["id"] for p in sent[300:]} - set(on_first)
    assert failover_s < CONFIRM_TIMEOUT_S + 15


def test_a_worker_fails_over_to_the_next_broker_when_its_broker_stops(
    node: PrivateNode, second_node: PrivateNode
):
    queue = unique_queue("wfail")
    url = f"{node.url};{second_node.url}"
    with WorkerProcess(url, queues=[queue], concurrency=1, extra_args=["--without-mingle"]) as worker:
        worker.wait_ready(timeout_s=60)
        node.rabbitmqctl("stop_app")
        try:
            stopped_at = time.monotonic()
            app = App("wfail", settings=Settings(broker_url=second_node.url))
            try:
                result = app.send_task("tests.integration.e2e_tasks.add", (2, 2), queue=queue)
                assert result.get(timeout=60) == 4
                took = time.monotonic() - stopped_at
            finally:
                app.close(timeout=5)
        finally:
            node.rabbitmqctl("start_app")
    report("R14", None, case="worker failover after stop_app", task_done_s=round(took, 2))
