"""close() ends the I/O thread at once, even while it waits out a reconnect backoff."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from broker_svc.connection import io_thread
from broker_svc.connection.io_thread import BrokerConnection
from broker_svc.settings import Settings
from tests.support.waiting import wait_for


def test_close_interrupts_the_reconnect_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing listens on port 1: each attempt is refused at once, then the thread backs off.
    monkeypatch.setattr(io_thread, "_BACKOFF_START_S", 5.0)
    conn = BrokerConnection(Settings(broker_url="amqp://guest:guest@127.0.0.1:1//"), name="close-test")
    with capture_logs() as logs:
        conn.start()
        wait_for(
            lambda: any(e["event"] == "broker_connect_failed" for e in logs),
            timeout_s=10,
            message="the first attempt did not fail",
        )
        started = time.monotonic()
        conn.close(timeout=5.0)
        closed_s = time.monotonic() - started
    assert not conn._thread.is_alive()
    assert closed_s < 1.0  # a sleep on the I/O thread would have held close() for the backoff
