"""The broker fixtures give a working URL, and test_vhost_url a vhost of its own when possible."""

from __future__ import annotations

import uuid
from urllib.parse import unquote, urlsplit

import pika

from tests.infra.session_broker import SessionBroker


def test_amqp_url_accepts_a_login_and_a_declare(amqp_url: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        connection.channel().queue_declare("", exclusive=True)
    finally:
        connection.close()


def test_test_vhost_url_is_a_separate_vhost_when_the_broker_can_be_administered(
    session_broker: SessionBroker, test_vhost_url: str
) -> None:
    queue = f"fixture-check-{uuid.uuid4().hex}"
    connection = pika.BlockingConnection(pika.URLParameters(test_vhost_url))
    try:
        connection.channel().queue_declare(queue, auto_delete=True)
        if session_broker.rabbitmqctl is None:
            assert test_vhost_url == session_broker.url
            return
        vhost = unquote(urlsplit(test_vhost_url).path[1:])
        assert vhost.startswith("clockwork-test-")
        assert queue in session_broker.rabbitmqctl("list_queues", "-q", "-p", vhost, "name").split()
        assert queue not in session_broker.rabbitmqctl("list_queues", "-q", "-p", "/", "name").split()
    finally:
        connection.close()
