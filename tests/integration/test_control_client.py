"""The blocking control client and ``app.control`` against real workers and a real broker."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from structlog.testing import capture_logs

from broker_svc import App, BrokerUnavailable, Settings
from broker_svc.connection.pika_internals import underlying_channel
from broker_svc.topology import EVENT_EXCHANGE, LEGACY_NAMESPACE, members_stream, revocation_log
from control import ControlClient
from control.api import Control
from control.protocol.request import MARKER_HEADER
from control.protocol.revoke_log import LOGGED_HEADER, RevokeEntry
from tests.support.amqp import channel
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

ADD = "tests.integration.e2e_tasks.add"


@pytest.fixture
def node(vhost_url: str) -> Iterator[WorkerProcess]:
    with WorkerProcess(vhost_url, queues=[f"q-{uuid.uuid4().hex[:8]}"], concurrency=1) as proc:
        yield proc.wait_ready()


@pytest.fixture
def app(vhost_url: str) -> Iterator[App]:
    app = App("control-client", settings=Settings(broker_url=vhost_url))
    yield app
    app.close(timeout=10)


@pytest.fixture
def client(vhost_url: str) -> Iterator[ControlClient]:
    with ControlClient(Settings(broker_url=vhost_url)) as client:
        yield client


def publish_worker_event(url: str, kind: str, hostname: str, *, timestamp: float, freq: float = 2.0) -> None:
    """A worker event as Celery's Heart sends it, into ``celeryev`` (and so the members stream)."""
    spec = members_stream()
    with channel(url) as ch:
        ch.exchange_declare(EVENT_EXCHANGE, exchange_type="topic", durable=True)
        ch.queue_declare(spec.name, durable=True, arguments=spec.arguments)
        ch.queue_bind(spec.name, EVENT_EXCHANGE, routing_key=spec.routing_key)
        ch.confirm_delivery()
        event = {
            "type": kind,
            "hostname": hostname,
            "timestamp": timestamp,
            "freq": freq,
            "clock": 1,
            "pid": 1,
        }
        ch.basic_publish(
            EVENT_EXCHANGE,
            kind.replace("-", "."),
            json.dumps(event).encode(),
            pika.BasicProperties(content_type="application/json", headers={"hostname": hostname}),
        )


def read_revocation_log(url: str, count: int) -> list[tuple[dict[str, Any], RevokeEntry]]:
    """The first ``count`` entries of the revocation log (markers skipped)."""
    spec = revocation_log(LEGACY_NAMESPACE)
    entries: list[tuple[dict[str, Any], RevokeEntry]] = []
    with channel(url) as ch:
        ch.queue_declare(spec.name, durable=True, arguments=spec.arguments)
        ch.basic_qos(prefetch_count=100)

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            _ch.basic_ack(method.delivery_tag)
            if MARKER_HEADER not in (props.headers or {}):  # catch-up markers of readers
                entries.append((dict(props.headers or {}), RevokeEntry.decode(body)))

        ch.basic_consume(spec.name, on_message, arguments={"x-stream-offset": "first"})
        wait_for(
            lambda: ch.connection.process_data_events(time_limit=0.05) or len(entries) >= count,
            timeout_s=10,
            message=f"{count} revocation log entries",
        )
        # pika's channel close would reject the deliveries it still holds, and a stream answers
        # a reject by closing the connection; closing the channel underneath just drops them.
        impl = underlying_channel(ch)
        assert impl is not None
        impl.close()
        wait_for(lambda: ch.connection.process_data_events(time_limit=0.05) or ch.is_closed, timeout_s=5,
                 message="stream channel closed")  # fmt: skip
    return entries


# -- app.control -------------------------------------------------------------------------------------


def test_app_control_inspect_ping_and_ping_see_the_worker(app: App, node: WorkerProcess):
    assert app.control.inspect(timeout=3).ping() == {node.name: {"ok": "pong"}}
    assert app.control.ping(timeout=3) == [{node.name: {"ok": "pong"}}]


def test_app_control_inspect_registered_lists_the_workers_tasks(app: App, node: WorkerProcess):
    registered = app.control.inspect(destination=[node.name], timeout=5).registered()
    assert ADD in registered[node.name]


def test_a_single_destination_name_returns_only_that_nodes_value_as_in_celery(app: App, node: WorkerProcess):
    assert app.control.inspect(destination=node.name, timeout=5).ping() == {"ok": "pong"}


def test_nobody_answering_gives_none_as_in_celery(app: App, node: WorkerProcess):
    assert app.control.inspect(destination=["nobody@nowhere"], timeout=0.5).ping() is None


def test_the_app_clock_moves_past_the_workers_clock_after_a_call(app: App, node: WorkerProcess):
    replies = app.control.inspect(destination=[node.name], timeout=5).clock()
    assert app.clock.value > replies[node.name]["clock"]


def test_the_app_closes_its_control_connection(vhost_url: str, node: WorkerProcess):
    app = App("closing", settings=Settings(broker_url=vhost_url))
    control = app.control
    assert app.control is control  # cached
    assert isinstance(control, Control)  # typed as the ControlPlane Protocol; the test reads its clients
    control.ping(destination=[node.name], timeout=3)
    [client] = control._clients
    app.close()
    assert client._connection.conn is None


# -- early return, membership and the timeout ------------------------------------------------------------


def test_a_destination_list_returns_as_soon_as_every_named_node_answered(
    client: ControlClient, node: WorkerProcess
):
    result = client.broadcast("ping", destination=[node.name], reply=True, timeout_s=5)
    assert result.replies == [{node.name: {"ok": "pong"}}]
    assert result.missing == frozenset() and result.elapsed_s < 2.0


def test_live_members_from_heartbeats_let_a_call_return_early(vhost_url: str, client: ControlClient, node):
    publish_worker_event(vhost_url, "worker-online", node.name, timestamp=time.time(), freq=30)
    result = client.broadcast("ping", reply=True, timeout_s=5)
    assert result.answered == {node.name} and result.missing == frozenset()
    assert node.name in (result.expected or ())
    assert result.elapsed_s < 2.0


def test_a_member_whose_heartbeats_stop_is_reported_missing_once_it_expires(vhost_url: str, client, node):
    publish_worker_event(vhost_url, "worker-online", node.name, timestamp=time.time(), freq=30)
    # Last heard 2.5 s ago with freq 2: alive for about 1.5 s more, and never answers.
    publish_worker_event(vhost_url, "worker-heartbeat", "ghost@nowhere", timestamp=time.time() - 2.5)
    result = client.broadcast("ping", reply=True, timeout_s=8)
    assert result.answered == {node.name}
    assert result.missing == {"ghost@nowhere"}
    assert 1.0 < result.elapsed_s < 4.0  # it expired; the call did not wait for the 8 s timeout


def test_a_member_that_went_offline_is_not_waited_for(vhost_url: str, client: ControlClient, node):
    publish_worker_event(vhost_url, "worker-online", node.name, timestamp=time.time(), freq=30)
    publish_worker_event(vhost_url, "worker-online", "gone@nowhere", timestamp=time.time() - 1)
    publish_worker_event(vhost_url, "worker-offline", "gone@nowhere", timestamp=time.time())
    result = client.broadcast("ping", reply=True, timeout_s=5)
    assert result.answered == {node.name} and result.missing == frozenset()
    assert result.elapsed_s < 2.0


def test_a_pattern_waits_only_for_the_members_it_matches(vhost_url: str, client: ControlClient, node):
    publish_worker_event(vhost_url, "worker-online", node.name, timestamp=time.time(), freq=30)
    publish_worker_event(vhost_url, "worker-online", "other@nowhere", timestamp=time.time(), freq=30)
    result = client.broadcast("ping", reply=True, pattern=node.name, timeout_s=5)
    assert result.answered == {node.name} and result.expected == frozenset({node.name})
    assert result.elapsed_s < 2.0


def test_a_members_stream_the_broker_refuses_falls_back_to_the_timeout(vhost_url: str):
    # A classic queue squatting on the stream's name makes the stream declare fail with 406, as
    # a broker without streams would. (Another namespace, so no worker declares the real one.)
    with channel(vhost_url) as ch:
        ch.queue_declare(members_stream("squat").name, durable=True)
    with capture_logs() as logs, ControlClient(Settings(broker_url=vhost_url), namespace="squat") as client:
        first = client.broadcast("ping", reply=True, timeout_s=0.5)
        client.close()  # the next call reconnects and tries the stream again
        second = client.broadcast("ping", reply=True, timeout_s=0.5)
    for result in (first, second):
        assert result.expected is None and result.replies == []
        assert 0.5 <= result.elapsed_s < 1.5
    assert [e["event"] for e in logs].count("members_stream_unavailable") == 1


def test_garbage_in_the_members_stream_is_skipped(vhost_url: str, client: ControlClient, node: WorkerProcess):
    spec = members_stream()
    client.broadcast("ping", destination=[node.name], reply=True, timeout_s=5)  # declares the stream
    with channel(vhost_url) as ch:
        for body, ctype in ((b"\xff", "application/json"), (b"[1, {}]", "application/json"), (b"x", None)):
            ch.basic_publish("", spec.name, body, pika.BasicProperties(content_type=ctype))
    publish_worker_event(vhost_url, "worker-online", node.name, timestamp=time.time(), freq=30)
    result = client.broadcast("ping", reply=True, timeout_s=5)
    assert result.answered == {node.name} and result.elapsed_s < 2.0


# -- inspect, revoke, errors ---------------------------------------------------------------------------------


def test_inspect_flattens_replies_and_says_who_is_missing(client: ControlClient, node: WorkerProcess):
    replies = client.inspect("ping", destination=[node.name, "nobody@nowhere"], timeout_s=1.0)
    assert replies == {node.name: {"ok": "pong"}}
    assert replies.missing == {"nobody@nowhere"}


def test_msgpack_requests_get_msgpack_replies_that_decode(vhost_url: str, node: WorkerProcess):
    with ControlClient(Settings(broker_url=vhost_url), serializer="msgpack") as client:
        assert client.inspect("ping", destination=[node.name], timeout_s=5) == {node.name: {"ok": "pong"}}


def test_revoke_is_logged_durably_before_it_is_broadcast(vhost_url: str, client: ControlClient, node):
    result = client.revoke(
        ["t-1", "t-2"], terminate=True, signal="SIGKILL", reply=True, destination=[node.name]
    )
    assert result.logged
    assert result.answered == {node.name}  # some reply (an error until the worker handles revoke)
    [(headers, entry)] = read_revocation_log(vhost_url, 1)
    assert entry.task_ids == ("t-1", "t-2") and entry.terminate and entry.signal == "SIGKILL"
    assert entry.hostname == client.hostname and entry.timestamp > 0
    assert isinstance(headers["clock"], int)


def test_revoke_with_no_worker_still_lands_in_the_log(vhost_url: str, client: ControlClient):
    result = client.revoke("lonely-task")
    assert result.logged and result.replies == []
    assert [entry.task_ids for _, entry in read_revocation_log(vhost_url, 1)] == [("lonely-task",)]


def test_the_revoke_broadcast_is_a_cast_marked_as_logged(vhost_url: str, client: ControlClient):
    with channel(vhost_url) as ch:
        ch.exchange_declare("celery.pidbox", exchange_type="fanout", durable=False)
        spy = ch.queue_declare("", exclusive=True).method.queue
        ch.queue_bind(spy, "celery.pidbox")
        client.revoke("spied-task")

        def get() -> tuple[Any, bytes] | None:
            method, props, body = ch.basic_get(spy, auto_ack=True)
            return (props, body) if method is not None else None

        got = wait_for(get, timeout_s=5, message="no revoke request on celery.pidbox")
    assert got is not None
    props, body = got
    assert props.headers[LOGGED_HEADER] is True and isinstance(props.headers["clock"], int)
    assert isinstance(props.headers["expires"], int) and props.content_type == "application/json"
    request = json.loads(body)
    assert request["method"] == "revoke" and "ticket" not in request  # a cast by default
    assert request["arguments"] == {"task_id": ["spied-task"], "terminate": False, "signal": "SIGTERM"}


def test_an_unreachable_broker_is_a_clear_error_without_the_password():
    settings = Settings(broker_url="amqp://guest:s3cret@127.0.0.1:1//", connect_timeout_s=2)
    with ControlClient(settings) as client, pytest.raises(BrokerUnavailable) as caught:
        client.broadcast("ping", reply=True)
    assert "s3cret" not in str(caught.value) and "127.0.0.1:1" in str(caught.value)


def test_the_client_reconnects_after_its_connection_is_lost(client: ControlClient, node: WorkerProcess):
    assert client.inspect("ping", destination=[node.name], timeout_s=5)
    assert client._connection.conn is not None
    # As if the broker had dropped an idle connection: the socket goes, with no AMQP close. (A
    # client-side conn.close() is no model of that, and races: pika would reject the member
    # stream's unacked deliveries, which a stream answers by closing the connection, 540.)
    client._connection.conn._impl._transport._sock.shutdown(socket.SHUT_RDWR)
    assert client.inspect("ping", destination=[node.name], timeout_s=5) == {node.name: {"ok": "pong"}}
