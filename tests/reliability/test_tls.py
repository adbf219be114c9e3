"""S4: TLS with client certificates on a private node; only the right certificates connect.

One private node with a TLS listener (``verify_peer``, ``fail_if_no_peer_cert = true``) and
certificates made by ``openssl`` in a temporary directory. The client (pika), the worker
(aio-pika) and ``ctl`` connect with the good ones; every other case fails with a clear error
within the connect timeout (plus the reconnect window for the one that is not refused outright).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_svc import App, BrokerSvcError, Settings
from tests.infra.node_setup import find_free_amqp_port
from tests.infra.private_node import PrivateNode
from tests.reliability.certs import TestPki, make_pki, tls_listener_conf
from tests.reliability.journal import report
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

CONNECT_TIMEOUT_S = 5.0
RECONNECT_WINDOW_S = 5.0


@dataclass(frozen=True)
class TlsNode:
    node: PrivateNode
    pki: TestPki
    tls_port: int

    def url(self, host: str = "localhost", *, scheme: str = "amqps") -> str:
        return f"{scheme}://guest:guest@{host}:{self.tls_port}/"

    def env(
        self, *, ca: Path | None = None, cert: Path | None = None, key: Path | None = None
    ) -> dict[str, str]:
        found = {"CLOCKWORK_SSL_CA_FILE": ca, "CLOCKWORK_SSL_CERT_FILE": cert, "CLOCKWORK_SSL_KEY_FILE": key}
        return {name: str(path) for name, path in found.items() if path is not None}


@pytest.fixture(scope="module")
def tls_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsNode]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    tls_port = find_free_amqp_port()
    node = PrivateNode.create(rabbitmq_conf=tls_listener_conf(pki, tls_port))
    while node.amqp_port == tls_port:  # pragma: no cover - a one in a hundred draw
        node.stop()
        node = PrivateNode.create(rabbitmq_conf=tls_listener_conf(pki, tls_port))
    try:
        node.start()
        yield TlsNode(node, pki, tls_port)
    finally:
        node.stop()


def _settings(tls: TlsNode, url: str, **files: Path | None) -> Settings:
    env = {"CLOCKWORK_BROKER_URL": url, **tls.env(**files)}  # the same path as an entry point's
    return Settings.from_env(
        env,
        connect_timeout_s=CONNECT_TIMEOUT_S,
        reconnect_window_s=RECONNECT_WINDOW_S,
        confirm="each",
        confirm_timeout_s=10.0,
    )


def _publish(settings: Settings, queue: str) -> tuple[bool, str, float]:
    """Send one task with a confirm: (confirmed, error text, seconds taken)."""
    app = App("tls", settings=settings)
    started = time.monotonic()
    try:
        app.send_task("t.x", (1,), queue=queue, ignore_result=True)
        return True, "", time.monotonic() - started
    except BrokerSvcError as exc:
        return False, f"{type(exc).__name__}: {exc}", time.monotonic() - started
    finally:
        try:
            app.close(timeout=2)
        except BrokerSvcError:
            pass


CASES = ["mtls_ok", "no_client_cert", "rogue_ca_client_cert", "untrusted_server_ca", "hostname_mismatch",
         "plain_to_tls_port"]  # fmt: skip


def _case(tls: TlsNode, case: str) -> Settings:
    pki = tls.pki
    good = {"ca": pki.ca.cert, "cert": pki.client.cert, "key": pki.client.key}
    if case == "mtls_ok":
        return _settings(tls, tls.url(), **good)
    if case == "no_client_cert":
        return _settings(tls, tls.url(), ca=pki.ca.cert)
    if case == "rogue_ca_client_cert":
        return _settings(tls, tls.url(), ca=pki.ca.cert, cert=pki.rogue_client.cert, key=pki.rogue_client.key)
    if case == "untrusted_server_ca":
        return _settings(tls, tls.url(), ca=pki.rogue_ca.cert, cert=pki.client.cert, key=pki.client.key)
    if case == "hostname_mismatch":  # the server's certificate names localhost only
        return _settings(tls, tls.url("127.0.0.1"), **good)
    assert case == "plain_to_tls_port"
    return _settings(tls, tls.url("127.0.0.1", scheme="amqp"))


def test_only_mutual_tls_with_the_right_certificates_connects_the_client(tls_node: TlsNode):
    queue = unique_queue("tls")
    outcomes: dict[str, dict[str, object]] = {}
    for case in CASES:
        ok, error, took = _publish(_case(tls_node, case), queue)
        outcomes[case] = {"connected": ok, "seconds": round(took, 2), "error": error}
    report("S4", None, side="client (pika)", cases=outcomes)
    assert outcomes["mtls_ok"]["connected"] is True, outcomes["mtls_ok"]
    for case in CASES[1:]:
        assert outcomes[case]["connected"] is False, (case, outcomes[case])
        # Refused certificates fail at once; only plain AMQP to the TLS port (no answer the client
        # understands) waits out the reconnect window.
        limit = CONNECT_TIMEOUT_S + RECONNECT_WINDOW_S + 5
        assert float(str(outcomes[case]["seconds"])) < limit, (case, outcomes[case])
    for case in ("untrusted_server_ca", "hostname_mismatch"):
        assert "certificate verify failed" in str(outcomes[case]["error"]).lower(), outcomes[case]
    for case in ("no_client_cert", "rogue_ca_client_cert"):
        assert "TLS" in str(outcomes[case]["error"]), outcomes[case]


def test_a_worker_runs_a_task_over_tls_and_ctl_pings_it(tls_node: TlsNode):
    pki = tls_node.pki
    files = {"ca": pki.ca.cert, "cert": pki.client.cert, "key": pki.client.key}
    queue = unique_queue("tls")
    url = tls_node.url()
    with WorkerProcess(url, queues=[queue], concurrency=1, env=tls_node.env(**files)) as worker:
        worker.wait_ready()
        app = App("tls-client", settings=_settings(tls_node, url, **files))
        try:
            assert app.send_task("tests.integration.e2e_tasks.add", (2, 3), queue=queue).get(timeout=30) == 5
        finally:
            app.close(timeout=5)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLOCKWORK_")}
        env.update(tls_node.env(**files))
        ping = subprocess.run(
            [sys.executable, "-m", "control.cli", "inspect", "ping", "-b", url, "-d", worker.name,
             "--timeout", "10", "--json"],
            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
        )  # fmt: skip
        assert ping.returncode == 0, ping.stderr
        assert worker.name in ping.stdout and "pong" in ping.stdout
        # The same ctl without a client certificate is refused, and says why.
        env.pop("CLOCKWORK_SSL_CERT_FILE")
        env.pop("CLOCKWORK_SSL_KEY_FILE")
        refused = subprocess.run(
            [sys.executable, "-m", "control.cli", "inspect", "ping", "-b", url, "--timeout", "5"],
            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
        )  # fmt: skip
    assert refused.returncode != 0 and "TLS" in refused.stderr, refused.stderr
    report("S4", None, side="worker (aio-pika) and ctl", task_over_tls=True, ctl_ping=True, ctl_refused=True)


def test_a_worker_without_a_client_certificate_exits_with_a_clear_error(tls_node: TlsNode):
    worker = WorkerProcess(
        tls_node.url(), queues=[unique_queue("tls")], concurrency=1, env=tls_node.env(ca=tls_node.pki.ca.cert)
    )
    try:
        started = time.monotonic()
        wait_for(
            lambda: worker.proc.poll() is not None,
            timeout_s=60,
            message=f"the worker kept running:\n{worker.log_text()[-3000:]}",
        )
        status = worker.proc.returncode
        took = time.monotonic() - started
        log = worker.log_text()
    finally:
        worker.close()
    report("S4", None, side="worker refused", exit_status=status, seconds=round(took, 1))
    assert status != 0
    assert "TLS handshake failed" in log, log[-3000:]
