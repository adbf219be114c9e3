"""A private RabbitMQ node starts beside the shared broker, answers AMQP and rabbitmqctl, and stops."""

from __future__ import annotations

import uuid

import pika
import pytest

from tests.infra.rabbit_node import PrivateNode, broker_reachable, ensure_rabbitmq_installed


@pytest.mark.timeout(90)
def test_private_node_starts_answers_amqp_and_rabbitmqctl_then_stops_cleanly() -> None:
    ensure_rabbitmq_installed()
    node = PrivateNode.create(rabbitmq_conf="consumer_timeout = 123456\n")
    node.start(timeout_s=60)
    try:
        assert node.is_running()
        assert broker_reachable(node.url, timeout_s=2.0)

        # A guest login and a declare prove the URL works; list_queues proves the CLI reaches this node.
        queue = f"private-node-check-{uuid.uuid4().hex}"
        connection = pika.BlockingConnection(pika.URLParameters(node.url))
        try:
            connection.channel().queue_declare(queue)
        finally:
            connection.close()
        assert queue in node.rabbitmqctl("list_queues", "-q", "name").split()

        # rabbitmq.conf in the node's own directory is the one in effect.
        setting = node.rabbitmqctl("eval", "application:get_env(rabbit, consumer_timeout).")
        assert setting.strip() == "{ok,123456}"
    finally:
        node.stop()

    assert not broker_reachable(node.url, timeout_s=1.0)
    assert not node.is_running()
    assert not node.base_dir.exists()
