"""The 3-node test cluster forms, answers on every node, and survives a fault round trip."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pika
import pika.exceptions
import pytest

from tests.infra.cluster import RabbitCluster, shared_cluster
from tests.infra.rabbit_node import broker_reachable
from tests.support.waiting import wait_for

# A 3-node cluster starves beside other tests on 2 cores: `make test` runs these after the rest.
pytestmark = pytest.mark.alone


@pytest.fixture(scope="session")
def cluster() -> Iterator[RabbitCluster]:
    # The same started cluster as tests/reliability's fixture (one cold start per session).
    with shared_cluster() as started:
        yield started


def test_cluster_forms_with_three_running_nodes_on_private_ports(cluster: RabbitCluster) -> None:
    names = sorted(node.node_name for node in cluster.nodes)
    for i in range(3):
        assert cluster.running_nodes(i) == names
    ports = [node.amqp_port for node in cluster.nodes]
    assert len(set(ports)) == 3 and 5672 not in ports
    assert cluster.failover_url == ";".join(cluster.urls)
    assert all(broker_reachable(url, timeout_s=2.0) for url in cluster.urls)


def test_close_all_connections_drops_a_consumer_that_list_consumers_counted(cluster: RabbitCluster) -> None:
    queue = f"cluster-consumer-{uuid.uuid4().hex[:10]}"
    connection = pika.BlockingConnection(pika.URLParameters(cluster.urls[1]))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, auto_delete=True)
        channel.basic_consume(queue, lambda *_args: None)
        assert cluster.list_consumers("/", queue) == 1
        cluster.close_all_connections("test: cluster harness check")
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker):
            connection.process_data_events(time_limit=10)
        wait_for(
            lambda: cluster.list_consumers("/", queue) == 0, timeout_s=10, message="consumer still listed"
        )
    finally:
        if connection.is_open:
            connection.close()


@pytest.mark.timeout(180)
def test_a_quorum_queue_keeps_its_messages_across_a_leader_kill_and_restart(cluster: RabbitCluster) -> None:
    queue = f"cluster-check-{uuid.uuid4().hex[:10]}"
    connection = pika.BlockingConnection(pika.URLParameters(cluster.urls[0]))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"})
        channel.basic_publish("", queue, b"kept", pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()

    cluster.transfer_leadership(queue, 2)
    assert cluster.leader_of(queue) == 2
    try:
        cluster.kill_node(2)
        assert not cluster.nodes[2].is_running()
        wait_for(lambda: cluster.leader_of(queue) in (0, 1), timeout_s=60, message="no new leader on 0 or 1")
        cluster.start_node(2)
        cluster.wait_healthy(timeout_s=120)
        cluster.freeze(1)
        assert cluster.leader_of(queue, node=0) is not None  # answers from a live node while 1 is frozen
        cluster.thaw(1)
    finally:
        cluster.restore()

    assert cluster.queue_messages(queue) == 1
    connection = pika.BlockingConnection(pika.URLParameters(cluster.urls[1]))
    try:
        channel = connection.channel()
        method, _props, body = channel.basic_get(queue, auto_ack=True)
        assert body == b"kept"
        channel.queue_delete(queue)
    finally:
        connection.close()
