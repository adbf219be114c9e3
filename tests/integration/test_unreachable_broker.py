"""A client whose broker cannot be reached says so, and its calls keep to their timeouts.

The broker is a local port nothing listens on (``free_port``): every attempt is refused at once,
as for a broker that is down or a mistyped port; or one that takes the connection and never
answers (``silent_broker``), as a broker that hangs or a host that drops packets.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings
from broker_svc.errors import BrokerUnavailable, PublishError, ResultTimeout, ResultUnreachable
from tests.support.metrics import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.timeout(60)


def test_get_names_the_broker_it_cannot_reach_and_close_keeps_to_its_timeout():
    url = f"amqp://guest:a-secret@127.0.0.1:{free_port()}/"
    app = App("unreachable", settings=Settings(broker_url=url))
    try:
        result = app.send_task("tests.anything", (1, 2))  # handed to the connection: returns at once
        started = time.monotonic()
        with pytest.raises(ResultUnreachable) as raised:
            result.get(timeout=1.0)
        assert time.monotonic() - started < 3.0
        error = raised.value
        # Both: code that waits for a timeout still catches it; the reason says what is wrong.
        assert isinstance(error, BrokerUnavailable) and isinstance(error, ResultTimeout)
        text = str(error)
        assert "no connection to amqp://guest:***@127.0.0.1:" in text and "refused" in text.lower(), text
        assert "a-secret" not in text
    finally:
        started = time.monotonic()
        with pytest.raises(PublishError, match="1 unconfirmed after 0.5 s: no connection to"):
            app.close(timeout=0.5)
        assert time.monotonic() - started < 1.5  # it used to take 2.5 s whatever the timeout


def test_a_plain_timeout_with_the_broker_up_stays_a_result_timeout(test_vhost_url: str):
    app = App("no-worker", settings=Settings(broker_url=test_vhost_url))
    try:
        result = app.send_task("tests.nobody.runs.this", queue="clockwork-test-nobody")
        app.flush(timeout=10)
        with pytest.raises(ResultTimeout) as raised:
            result.get(timeout=0.5)
        assert not isinstance(raised.value, BrokerUnavailable)
    finally:
        app.close(timeout=10)


def test_a_send_that_waits_for_its_confirm_fails_naming_the_broker_and_why():
    url = f"amqp://guest:a-secret@127.0.0.1:{free_port()}/"
    app = App("unreachable-each", settings=Settings(broker_url=url, confirm="each", reconnect_window_s=1))
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            app.send_task("tests.anything", (1, 2))
        text = str(raised.value)
        assert "no connection to amqp://guest:***@127.0.0.1:" in text and "refused" in text.lower(), text
        assert "a-secret" not in text
    finally:
        app.close(timeout=0.5)


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """The URL of a port that accepts connections and never answers a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:  # closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"amqp://guest:guest@127.0.0.1:{server.getsockname()[1]}/"
    finally:
        server.close()
        thread.join(timeout=5)
        for conn in held:  # the clients still in their handshake read the end of it and stop
            conn.close()


def test_close_keeps_to_its_timeout_after_reading_task_states_from_a_broker_that_never_answers(
    silent_broker: str,
):
    app = App("silent-states", settings=Settings(broker_url=silent_broker, task_states=True))
    with pytest.raises(BrokerUnavailable):
        app.jobs.history("some-task", timeout=0.5)  # its reader is still in its handshake
    started = time.monotonic()
    app.close(timeout=0.5)
    # Generous for a slow machine, below the 3.0 s it took whatever the timeout (the reader's join).
    assert time.monotonic() - started < 2.0


def test_a_spooling_close_waits_about_a_second_for_a_broker_that_never_answers(
    silent_broker: str, tmp_path: Path
):
    # docs/guide.md, "When the broker is down": close() gives the drain up to its timeout, 1 s if
    # the broker is down; what is not confirmed stays spooled.
    app = App("silent-spool", settings=Settings(broker_url=silent_broker, spool_dir=str(tmp_path)))
    app.send_task("tests.anything", (1, 2))
    started = time.monotonic()
    app.close(timeout=30)
    assert time.monotonic() - started < 3.0
    # What the broker never confirmed is still there for the next process.
    again = App("silent-spool", settings=Settings(broker_url=silent_broker, spool_dir=str(tmp_path)))
    try:
        again.connect()

        def one_spooled() -> bool:
            stats = again.spool_stats()
            return stats is not None and stats.depth == 1

        wait_for(one_spooled, timeout_s=10, message="the task left spooled")
    finally:
        again.close(timeout=0.1)


def test_inspect_against_a_broker_that_never_answers_fails_typed_naming_the_broker(silent_broker: str):
    # pika ends such a handshake in its connector's own error (AMQPConnectorStackTimeout), which is
    # no AMQPError: it reached the caller raw, after 20 s, before the blocking clients shared one opener.
    app = App("silent-inspect", settings=Settings(broker_url=silent_broker, connect_timeout_s=1))
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            app.control.inspect(timeout=1).ping()
        assert "127.0.0.1" in str(raised.value), raised.value
    finally:
        app.close(timeout=0.5)
