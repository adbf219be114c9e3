"""Pipelined confirms: what a lost connection, threads and interpreter exit do to published tasks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from urllib.parse import unquote, urlsplit

import pytest

from broker_svc import App, PublishError, Settings
from tests.support.amqp import drain, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess


def _vhost(url: str) -> str:
    return Settings(broker_url=url).virtual_host


def test_unconfirmed_publishes_are_retried_after_a_forced_connection_close(
    test_vhost_url: str, queue: str, session_broker
):
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from the broker side)")
    app = App("victim", settings=Settings(broker_url=test_vhost_url, publish_attempts=5))
    try:
        sent = 0
        for round_ in range(3):
            for i in range(2000):
                app.send_task("t.x", (round_, i), queue=queue, ignore_result=True)
                sent += 1
            # Drop every connection of this vhost while thousands are in flight.
            session_broker.rabbitmqctl("close_all_connections", "-p", _vhost(test_vhost_url), "chaos test")
        app.flush(timeout=60)
    finally:
        app.close(timeout=30)
    got = drain(test_vhost_url, queue)
    ids = {tuple(_args(m.body)) for m in got}
    assert len(ids) == sent  # none lost; redelivered duplicates are allowed and counted below
    print(f"published {sent}, in queue {len(got)}, duplicates {len(got) - len(ids)}")


def _args(body: bytes) -> list:
    import msgpack

    return list(msgpack.unpackb(body)[0])


def test_many_threads_share_one_app(test_vhost_url: str, queue: str):
    worker = WorkerProcess(test_vhost_url, queues=[queue], concurrency=2).wait_ready()
    app = App("threads", settings=Settings(broker_url=test_vhost_url))
    errors: list[BaseException] = []
    totals: dict[int, int] = {}

    def work(n: int) -> None:
        try:
            results = [
                app.send_task("tests.integration.e2e_tasks.add", (n, i), queue=queue) for i in range(200)
            ]
            totals[n] = sum(r.get(timeout=60) for r in results)
        except BaseException as exc:  # reported below, with the thread's number
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert errors == []
        assert totals == {n: 200 * n + sum(range(200)) for n in range(4)}
    finally:
        app.close()
        worker.close()


def test_each_threads_sends_keep_their_order_whether_it_or_the_io_thread_writes_them(
    test_vhost_url: str, queue: str
):
    # A send on an idle connection is written by its caller, the rest by the I/O thread
    # (BrokerConnection._send_here): lone sends (a flush before each) and bursts, from threads
    # at once, must all arrive, each thread's in the order it sent them.
    app = App("order", settings=Settings(broker_url=test_vhost_url))
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            seq = 0
            for burst in (1, 1, 50, 1, 200, 1, 1, 20, 1):
                for _ in range(burst):
                    app.send_task("t.x", (n, seq), queue=queue, ignore_result=True)
                    seq += 1
                app.flush(timeout=30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        app.close()
    assert errors == []
    got = [_args(m.body) for m in drain(test_vhost_url, queue)]
    for n in range(6):
        assert [seq for thread, seq in got if thread == n] == list(range(276))


def test_interpreter_exit_waits_for_every_confirm(test_vhost_url: str, queue: str):
    script = textwrap.dedent(
        f"""
        from broker_svc import App, PublishError, Settings
        app = App("exit", settings=Settings(broker_url={test_vhost_url!r}))
        for i in range(5000):
            app.send_task("t.x", (i,), queue={queue!r}, ignore_result=True)
        # no flush, no close: exiting must still wait for the broker's confirms
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120, env=dict(os.environ))
    assert queue_depth(test_vhost_url, queue) == 5000


def test_a_second_sigterm_exits_at_once_and_loses_nothing(test_vhost_url: str, queue: str, client: App):
    # Multiplier 2: two running and two reserved (the default 1 reserves none).
    worker = WorkerProcess(
        test_vhost_url, queues=[queue], concurrency=2, extra_args=["--prefetch-multiplier", "2"]
    ).wait_ready()
    try:
        results = [
            client.send_task("tests.integration.e2e_tasks.sleep_s", (20, str(i)), queue=queue)
            for i in range(4)
        ]
        client.flush(timeout=10)
        # All four delivered to the worker: two running, two reserved.
        wait_for(lambda: queue_depth(test_vhost_url, queue) == 0, timeout_s=20, message="nothing delivered")
        import signal as _signal
        import time

        worker.proc.send_signal(_signal.SIGTERM)
        wait_for(lambda: worker.count("worker_stopping") == 1, timeout_s=10, message="no graceful stop began")
        started = time.monotonic()
        worker.proc.send_signal(_signal.SIGTERM)
        assert worker.proc.wait(timeout=10) != 0
        assert time.monotonic() - started < 5  # it did not wait for the 20 s tasks
    finally:
        worker.close()
    # Everything unfinished is back in the queue for the next worker.
    wait_for(lambda: queue_depth(test_vhost_url, queue) == 4, timeout_s=30, message="tasks were lost")
    assert not any(r.ready() for r in results)


def test_user_and_password_never_leak_into_errors(test_vhost_url: str):
    parts = urlsplit(test_vhost_url)
    bad = test_vhost_url.replace(f":{unquote(parts.password or '')}@", ":canary-s3cret@")
    app = App("leak", settings=Settings(broker_url=bad, reconnect_window_s=2))
    try:
        result = app.send_task("t.x", queue="nowhere")
        with pytest.raises(Exception) as info:
            result.get(timeout=20)
        assert "canary-s3cret" not in str(info.value) and "canary-s3cret" not in repr(app)
        with pytest.raises(PublishError) as closing:
            app.close(timeout=1)  # reports the message it could not deliver
        assert "canary-s3cret" not in str(closing.value)
    finally:
        app.close(timeout=1)
