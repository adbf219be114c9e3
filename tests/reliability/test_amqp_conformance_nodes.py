"""Our AMQP 0-9-1 client against a broker of its own: small frames, alarms, TLS, closes, a restart.

The half of the conformance suite (``tests/integration/test_amqp_conformance.py``) that needs to
configure or break a broker, so it runs on one private node (never the shared broker): its
``frame_max`` is 4096 (the least AMQP allows) and its ``channel_max`` 8, it has a TLS listener
that requires a client certificate, its memory watermark is lowered for one test and its app is
stopped and started for another (last). Each test runs for both concurrency policies of the one
core, ``FeedConnection`` (one reader) and ``SharedFeedConnection`` (threads sharing it).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from broker_svc import Settings
from broker_svc.amqp.delivery import ConnectionLost
from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from broker_svc.errors import BrokerUnavailable
from broker_svc.topology import QueueSpec
from broker_svc.wire.task.task_message import WireMessage
from tests.infra.node_setup import find_free_amqp_port
from tests.infra.private_node import PrivateNode
from tests.reliability.certs import TestPki, make_pki, tls_listener_conf
from tests.support.amqp import channel, drain, publish_raw
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue

POLICIES = ["single", "shared"]
FRAME_MAX = 4096
CHANNEL_MAX = 8


@dataclass(frozen=True)
class Node:
    node: PrivateNode
    pki: TestPki
    tls_port: int

    def tls_url(self, host: str = "localhost") -> str:
        return f"amqps://guest:guest@{host}:{self.tls_port}/"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    tls_port = find_free_amqp_port()
    conf = f"frame_max = {FRAME_MAX}\nchannel_max = {CHANNEL_MAX}\n" + tls_listener_conf(pki, tls_port)
    private = PrivateNode.create(rabbitmq_conf=conf)
    while private.amqp_port == tls_port:  # pragma: no cover - a one in a hundred draw
        private.stop()
        private = PrivateNode.create(rabbitmq_conf=conf)
    try:
        private.start()
        yield Node(private, pki, tls_port)
    finally:
        private.stop()


@pytest.fixture
def queue(node: Node) -> str:
    name = unique_queue("confn")
    with channel(node.node.url) as ch:
        ch.queue_declare(name, durable=True)
    return name


def _feed(policy: str, settings: Settings, queue: str, *, name: str) -> FeedConnection:
    kind = FeedConnection if policy == "single" else SharedFeedConnection
    spec = QueueSpec(queue, durable=True)
    return kind(settings, name=name, queues=[queue], prefetch=1, declare=[spec])


def _settings(url: str, **options: str | float | None) -> Settings:
    return Settings.from_url(url, heartbeat_s=30, confirm_timeout_s=30.0, **options)


def _connected(policy: str, settings: Settings, queue: str, *, name: str) -> FeedConnection:
    connection = _feed(policy, settings, queue, name=name)
    connection.connect()
    return connection


def _listed(node: PrivateNode, name: str, *columns: str) -> list[str] | None:
    out = node.rabbitmqctl("list_connections", "-q", "--no-table-headers", *columns, "client_properties")
    rows = [line.split("\t") for line in out.splitlines() if f'"{name}"' in line]
    return rows[0][: len(columns)] if rows else None


def _name(policy: str) -> str:
    return f"conformance-{policy}-{uuid.uuid4().hex[:8]}"


def _message(body: bytes) -> WireMessage:
    return WireMessage(
        body=body, content_type="application/octet-stream", content_encoding="binary", headers={}
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_the_brokers_frame_max_and_channel_max_are_honoured_and_a_big_body_arrives_whole(
    node: Node, queue: str, policy: str
):
    # 50 kB in frames of at most 4096 bytes: a client that kept its own 128 KiB would send frames
    # the broker refuses (501 FRAME_ERROR closes the connection).
    name = _name(policy)
    body = bytes(range(256)) * 200
    connection = _connected(policy, _settings(node.node.url), queue, name=name)
    try:
        row = _listed(node.node, name, "frame_max", "channel_max")
        assert row is not None and int(row[0]) == FRAME_MAX and 1 <= int(row[1]) <= CHANNEL_MAX
        connection.publish(_message(body), queue)
        delivery = connection.next_delivery(10.0)
        assert delivery is not None and delivery.body == body
        connection.ack(delivery)
    finally:
        connection.close()
    assert drain(node.node.url, queue) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_a_memory_alarm_blocks_a_publish_which_carries_on_once_unblocked(node: Node, queue: str, policy: str):
    connection = _connected(policy, _settings(node.node.url), queue, name=_name(policy))
    done: list[BaseException | None] = []

    def publish() -> None:
        try:
            connection.publish(_message(b"while blocked"), queue)
            done.append(None)
        except BaseException as exc:  # reported below
            done.append(exc)

    publisher = threading.Thread(target=publish)
    try:
        assert connection.blocked is None
        node.node.rabbitmqctl("set_vm_memory_high_watermark", "0.00001")
        try:
            publisher.start()
            reason = wait_for(lambda: connection.blocked, timeout_s=20, message="no connection.blocked")
            assert reason is not None and "memory" in reason.lower()
            assert not done  # the broker holds the publish: no confirm while blocked
        finally:
            node.node.rabbitmqctl("set_vm_memory_high_watermark", "0.4")
        publisher.join(30)
        assert done == [None]  # confirmed once unblocked, on the same connection
        got: list[bytes] = []

        def unblocked() -> bool:
            delivery = connection.next_delivery(0.2)  # reads (and dispatches) what arrives
            if delivery is not None:
                got.append(delivery.body)
                connection.ack(delivery)
            return connection.blocked is None

        wait_for(unblocked, timeout_s=10, message="connection.unblocked never came")
    finally:
        publisher.join(5)
        connection.close()
    assert got + [m.body for m in drain(node.node.url, queue)] == [b"while blocked"]


@pytest.mark.parametrize("policy", POLICIES)
def test_tls_with_the_right_certificates_consumes_and_publishes_and_a_rogue_ca_is_refused(
    node: Node, queue: str, policy: str
):
    pki = node.pki
    name = _name(policy)
    files = {
        "ssl_ca_file": str(pki.ca.cert),
        "ssl_cert_file": str(pki.client.cert),
        "ssl_key_file": str(pki.client.key),
    }
    connection = _connected(policy, _settings(node.tls_url(), **files), queue, name=name)
    try:
        assert _listed(node.node, name, "ssl") == ["true"]
        publish_raw(node.node.url, queue, b"x" * 10_000, headers={"id": "over-tls"})
        delivery = connection.next_delivery(10.0)
        assert delivery is not None and delivery.headers["id"] == "over-tls" and len(delivery.body) == 10_000
        connection.ack(delivery)
        connection.publish(_message(b"back over tls"), queue)
        echoed = connection.next_delivery(10.0)
        assert echoed is not None and echoed.body == b"back over tls"
        connection.ack(echoed)
    finally:
        connection.close()
    rogue = {**files, "ssl_ca_file": str(pki.rogue_ca.cert)}
    settings = _settings(node.tls_url(), connect_timeout_s=5.0, **rogue)
    with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        _feed(policy, settings, queue, name=_name(policy)).connect()


def _ending(node: PrivateNode, name: str) -> str | None:
    """How the broker logged the end of the connection named ``name``: "handshake" (a close it
    answered with close-ok), "dropped" (the socket went without one), or None (not ended yet).

    Its lines: "closing AMQP connection <pid> (... - name, vhost: ...)", alone for a handshake,
    or followed by "<pid> client unexpectedly closed TCP connection" for a dropped socket.
    """
    lines = (node.base_dir / "log" / f"{node.node_name}.log").read_text(errors="replace").splitlines()
    for at, line in enumerate(lines):
        if "closing AMQP connection" in line and f" - {name}," in line:
            process = line.split("closing AMQP connection ", 1)[1].split(" ", 1)[0]
            after = [later for later in lines[at + 1 : at + 3] if process in later]
            return "dropped" if any("unexpectedly closed" in later for later in after) else "handshake"
    return None


@pytest.mark.parametrize("policy", POLICIES)
def test_a_client_close_is_a_close_handshake_not_a_dropped_socket(node: Node, queue: str, policy: str):
    name = _name(policy)
    connection = _connected(policy, _settings(node.node.url), queue, name=name)
    connection.close()
    assert connection._sock is None
    ended = wait_for(lambda: _ending(node.node, name), timeout_s=10, message="the broker logged no end")
    assert ended == "handshake"
    # The control: the broker tells a socket dropped without a close apart.
    dropped = _name(policy)
    _connected(policy, _settings(node.node.url), queue, name=dropped).drop()
    ended = wait_for(lambda: _ending(node.node, dropped), timeout_s=10, message="the broker logged no end")
    assert ended == "dropped"


@pytest.mark.parametrize("policy", POLICIES)
def test_after_a_broker_restart_the_client_connects_again_and_consumes(node: Node, queue: str, policy: str):
    # Last in the module: the node's app is stopped and started (every connection to it closes).
    settings = _settings(node.node.url, connect_timeout_s=2.0)
    connection = _connected(policy, settings, queue, name=_name(policy))
    try:
        node.node.rabbitmqctl("stop_app")
        try:
            with pytest.raises(ConnectionLost):
                for _ in range(100):  # each wait ends within 0.2 s; the loss comes first
                    connection.next_delivery(0.2)
            with pytest.raises(BrokerUnavailable):
                connection.connect()  # nobody listens
        finally:
            node.node.rabbitmqctl("start_app")

        def connected() -> bool:
            try:
                connection.connect()
            except BrokerUnavailable:
                return False
            return True

        wait_for(connected, timeout_s=60, interval_s=0.5, message="the client never connected again")
        publish_raw(node.node.url, queue, b"{}", headers={"id": "after-restart"})
        delivery = connection.next_delivery(10.0)
        assert delivery is not None and delivery.headers["id"] == "after-restart"
        connection.ack(delivery)
    finally:
        connection.close()
