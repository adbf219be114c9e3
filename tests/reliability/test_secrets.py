"""S5: a canary password never shows up in logs, reprs or exception text, whatever fails.

The password is a canary; the connection fails in several ways (nothing listening, a refused
login, TLS to a plain AMQP port) for the client (pika), ``ctl`` and its control client, and the
worker (aio-pika), with every log at DEBUG, pika's and aiormq's included where we control them.
Everything they print, plus the reprs, messages and tracebacks (with causes) of what they raise,
is searched for the canary.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from urllib.parse import urlsplit

import pytest

from tests.infra.node_setup import find_free_amqp_port
from tests.reliability.journal import report
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

CANARY = "canary-Pw-7f3a9c"


def _urls(amqp_url: str) -> dict[str, str]:
    broker = urlsplit(amqp_url)
    host, port = broker.hostname, broker.port or 5672
    return {
        "wrong_port": f"amqp://guest:{CANARY}@127.0.0.1:{find_free_amqp_port()}/",
        "refused_auth": f"amqp://guest:{CANARY}@{host}:{port}/",
        "tls_to_plain_port": f"amqps://guest:{CANARY}@{host}:{port}/",
        "failover_list": f"amqp://guest:{CANARY}@127.0.0.1:{find_free_amqp_port()}/;"
        f"amqp://guest:{CANARY}@{host}:{port}/",
    }


_CLIENT_SCRIPT = textwrap.dedent(
    """
    import logging, sys, traceback
    from broker_svc import App, BrokerSvcError, Settings
    from broker_svc.logging import configure_logging
    from control.blocking.client import ControlClient

    configure_logging("debug", json=True)
    for noisy in ("pika", "aio_pika", "aiormq"):
        logging.getLogger(noisy).setLevel(logging.DEBUG)
    url = sys.argv[1]
    settings = Settings(broker_url=url, confirm="each", reconnect_window_s=2, connect_timeout_s=3)
    print("settings", repr(settings), str(settings), settings.safe_broker_url)
    app = App("canary", settings=settings)
    print("app", repr(app))
    for call in (lambda: app.send_task("t.x", (1,), queue="q", ignore_result=True),
                 lambda: app.close(timeout=1),
                 lambda: ControlClient(settings).broadcast("ping", reply=True, timeout_s=1)):
        try:
            call()
            print("no error")
        except BrokerSvcError as exc:
            print("error", repr(exc), str(exc))
            print("".join(traceback.format_exception(exc)))
    """
)


def _run_client(url: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT_SCRIPT, url],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")},
    )  # fmt: skip
    assert "error" in proc.stdout, proc.stdout + proc.stderr  # it did fail, and said so
    return proc.stdout + proc.stderr


def _run_ctl(url: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "control.cli", "inspect", "ping", "-b", url, "--timeout", "2"],
        capture_output=True, text=True, timeout=90, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")},
    )  # fmt: skip
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def _run_worker(url: str) -> str:
    worker = WorkerProcess(url, queues=[unique_queue("canary")], concurrency=1, extra_args=["-l", "debug"])
    try:
        # Refused logins and TLS errors end the worker; an unreachable broker is retried: either
        # way, two attempts have been logged (or the process ended) when this returns.
        wait_for(
            lambda: worker.proc.poll() is not None or worker.count("broker_connect_failed") >= 2,
            timeout_s=60,
            message="the worker neither failed nor retried",
        )
        worker.kill()
        return worker.log_text()
    finally:
        worker.close()


@pytest.mark.parametrize("side", ["client", "ctl", "worker"])
def test_a_canary_password_appears_in_no_log_repr_or_error(amqp_url: str, side: str):
    run = {"client": _run_client, "ctl": _run_ctl, "worker": _run_worker}[side]
    found: dict[str, int] = {}
    for case, url in _urls(amqp_url).items():
        if side == "ctl" and case == "failover_list":
            continue  # the same parser and client as the other cases
        text = run(url)
        assert "***@" in text, (side, case, text[-2000:])  # the URL was shown, redacted
        found[case] = text.count(CANARY)
        if found[case]:
            line = next(line for line in text.splitlines() if CANARY in line)
            print(f"LEAK {side}/{case}: {line[:500]}")
    report("S5", None, side=side, occurrences=sum(found.values()), cases=found)
    assert found and sum(found.values()) == 0, found
