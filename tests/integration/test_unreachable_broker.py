"""A client whose broker cannot be reached says so, and its calls keep to their timeouts.

The broker is a local port nothing listens on (``free_port``): every attempt is refused at once,
as for a broker that is down or a mistyped port.
"""

from __future__ import annotations

import time

import pytest

from broker_svc import App, Settings
from broker_svc.errors import BrokerUnavailable, PublishError, ResultTimeout, ResultUnreachable
from tests.support.metrics import free_port

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
