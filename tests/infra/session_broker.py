"""Choose the broker for a pytest session: $AMQP_URL, the local broker, Docker, or a private node."""

from __future__ import annotations

import os
import secrets
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from tests.infra.broker_probe import LOCAL_BROKER_URL, broker_reachable, redact_url, url_with_vhost
from tests.infra.docker_engine import docker_engine_reachable
from tests.infra.rabbit_node import PrivateNode, rabbitmqctl_for
from tests.infra.rabbitmq_tools import (
    Rabbitmqctl,
    RabbitmqctlError,
    RabbitNodeError,
    ensure_rabbitmq_installed,
    system_rabbitmqctl_for,
)

CONTAINER_IMAGE = "rabbitmq:3.13-management"

_HELP = """\
No RabbitMQ broker for the test suite. Do one of:
  - export AMQP_URL=amqp://USER:PASS@HOST:PORT/ pointing at a running RabbitMQ;
  - start RabbitMQ on 127.0.0.1:5672 (guest/guest);
  - start a Docker engine (the suite then runs {image} with testcontainers);
  - install rabbitmq-server (Debian/Ubuntu: sudo apt-get install rabbitmq-server), so the
    suite can start a private node; `make test` does this for you when run as root.
What was tried:
"""


class NoBrokerError(RuntimeError):
    """No broker is reachable and none could be started; the message says what to do."""


@dataclass(frozen=True)
class SessionBroker:
    """The broker a test session runs against.

    Attributes:
        url: AMQP URL (default vhost).
        rabbitmqctl: Runs ``rabbitmqctl`` against this broker; None when we cannot administer it.
        origin: Where it came from, for the test report header.
    """

    url: str
    rabbitmqctl: Rabbitmqctl | None
    origin: str

    @contextmanager
    def own_vhost(self, prefix: str, *, fallback: str | None = None) -> Iterator[str]:
        """A vhost made for the caller and deleted after it; its URL.

        Without a ``rabbitmqctl`` for the broker (a remote ``AMQP_URL``), yields ``fallback`` (or
        the broker's URL) unchanged.
        """
        ctl = self.rabbitmqctl
        if ctl is None:
            yield fallback or self.url
            return
        vhost = f"{prefix}-{secrets.token_hex(6)}"
        user = unquote(urlsplit(self.url).username or "guest")
        ctl("add_vhost", vhost)
        try:
            ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
            yield url_with_vhost(self.url, vhost)
        finally:
            ctl("delete_vhost", vhost)


def open_session_broker(stack: ExitStack, *, state_dir: Path | None = None) -> SessionBroker:
    """Find or start the session's broker; anything started is stopped when ``stack`` closes.

    Args:
        stack: Receives the clean-up of a container or private node started here.
        state_dir: Where ``make`` records a private node, so its ``rabbitmqctl`` can be found.

    Returns:
        The broker.

    Raises:
        NoBrokerError: Nothing worked; the message lists what to do and what was tried.
    """
    if url := os.environ.get("AMQP_URL"):
        if not broker_reachable(url, timeout_s=5.0):
            raise NoBrokerError(
                f"AMQP_URL={redact_url(url)} does not answer. Start that broker, correct AMQP_URL, "
                "or unset it to let the suite find or start one."
            )
        return SessionBroker(url, rabbitmqctl_for(url, state_dir=state_dir), "$AMQP_URL")
    if broker_reachable(LOCAL_BROKER_URL, timeout_s=2.0):
        return SessionBroker(LOCAL_BROKER_URL, system_rabbitmqctl_for(LOCAL_BROKER_URL), "local broker")
    tried = ["nothing answers AMQP on 127.0.0.1:5672"]
    if docker_engine_reachable():
        try:
            return _start_container(stack)
        except Exception as exc:  # any testcontainers/docker failure: fall through to a private node
            tried.append(f"testcontainers failed: {exc!r}")
    else:
        tried.append("no Docker engine answers")
    try:
        ensure_rabbitmq_installed()
        node = PrivateNode.create()
        node.start(timeout_s=120.0)
    except RabbitNodeError as exc:
        tried.append(f"private node: {exc}")
        report = "\n".join(f"  - {attempt}" for attempt in tried)
        raise NoBrokerError(_HELP.format(image=CONTAINER_IMAGE) + report) from exc
    stack.callback(node.stop)
    return SessionBroker(node.url, node.rabbitmqctl, f"private node {node.node_name}")


def _start_container(stack: ExitStack) -> SessionBroker:
    with warnings.catch_warnings():
        # testcontainers' own deprecation warnings must not fail the run (filterwarnings = error).
        warnings.simplefilter("ignore", DeprecationWarning)
        from testcontainers.community.rabbitmq import RabbitMqContainer

        # Typed as Any: testcontainers' constructor is unannotated.
        factory: Callable[[str], Any] = RabbitMqContainer
        container = factory(CONTAINER_IMAGE)
        try:
            container.start()
        except BaseException:
            container.stop()  # a failed readiness probe leaves the container running
            raise
    stack.callback(container.stop)
    host = str(container.get_container_host_ip())
    port = int(container.get_exposed_port(container.port))
    user, password = quote(container.username, safe=""), quote(container.password, safe="")

    def container_rabbitmqctl(*args: str, timeout_s: float = 60.0) -> str:
        result = container.exec(["timeout", str(int(timeout_s)), "rabbitmqctl", *args])
        output = bytes(result.output).decode(errors="replace")
        if result.exit_code != 0:
            raise RabbitmqctlError(
                f"`rabbitmqctl {' '.join(args)}` in the container exited with status {result.exit_code}: "
                f"{output.strip()[-1000:]}"
            )
        return output

    return SessionBroker(f"amqp://{user}:{password}@{host}:{port}/", container_rabbitmqctl, "testcontainers")
