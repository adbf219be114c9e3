"""Two apps in one vhost, each with its workers and a scheduler (docs/guide.md, "Many apps on one broker").

``shop`` (tests/integration/shop_app.py) and ``billing`` (billing_app.py) share a vhost, as apps
share ``/`` on a production broker. With an ``app_namespace`` each, neither acts on the other's
shared state: their chords (from our client and from a Celery client with ``ChordBackend``) all
return, neither scheduler fires the other's entries, and nothing is left in a queue that no
worker consumes. Without one (the legacy namespace, which they share), a chord is joined by
whichever app's worker is the joiner, and its body still reaches its own app's queue: it carries
its destination; and the workers warn that the two apps share the namespace.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chord

from broker_svc import App, Settings
from broker_svc import chord as our_chord
from broker_svc.schedules.client import ScheduleClient
from tests.infra.rabbitmq_tools import Rabbitmqctl
from tests.infra.session_broker import SessionBroker
from tests.integration.many_apps_notes import read_notes
from tests.interop.conftest import close_celery_client
from tests.support.cli import run_ctl
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

pytestmark = pytest.mark.interop

BACKEND = "broker_svc.celery_backend:ChordBackend"
SHOP = "tests.integration.shop_app:app"
BILLING = "tests.integration.billing_app:app"
SHOP_QUEUES = ["shop"]
BILLING_QUEUES = ["billing", "billing-totals"]


def worker_env(notes: Path, namespace: str | None) -> dict[str, str]:
    env = {"MANY_APPS_NOTES": str(notes)}
    if namespace is not None:
        env["CLOCKWORK_APP_NAMESPACE"] = namespace
    return env


def our_client(url: str, app_name: str, namespace: str | None) -> App:
    """A client app named apart from the workers' app; it declares billing's body task as its module does."""
    client = App(
        f"{app_name}-client",
        settings=Settings(broker_url=url, default_queue=app_name, app_namespace=namespace),
    )
    client.task(name="billing.total", queue="billing-totals")(sum)
    return client


def celery_client(url: str, app_name: str, namespace: str | None) -> Celery:
    client = Celery(f"{app_name}-celery", broker=url, backend=BACKEND)
    client.conf.update(
        accept_content=["json"], result_accept_content=["json"], task_serializer="json",
        task_default_queue=app_name, task_routes={"billing.total": {"queue": "billing-totals"}},
    )  # fmt: skip
    if namespace is not None:
        client.conf.app_namespace = namespace
    return client


def our_chords(client: App, app_name: str, count: int) -> list[int]:
    part, body = ("shop.add", "shop.xsum") if app_name == "shop" else ("billing.mul", "billing.total")
    results = [
        our_chord([client.signature(part, (i, n)) for i in range(3)])(client.signature(body))
        for n in range(count)
    ]
    return [result.get(timeout=30) for result in results]


def celery_chords(client: Celery, app_name: str, count: int) -> list[int]:
    part, body = ("shop.add", "shop.xsum") if app_name == "shop" else ("billing.mul", "billing.total")
    results = [
        chord(client.signature(part, args=(i, n)) for i in range(3))(client.signature(body))
        for n in range(count)
    ]
    return [result.get(timeout=30) for result in results]


def expected(app_name: str, count: int) -> list[int]:
    if app_name == "shop":
        return [sum(i + n for i in range(3)) for n in range(count)]
    return [sum(i * n for i in range(3)) for n in range(count)]


def queues(ctl: Rabbitmqctl, vhost: str) -> list[dict[str, Any]]:
    out = ctl(
        "list_queues", "-p", vhost, "--formatter", "json", "name", "type", "messages_ready", "consumers"
    )
    rows: list[dict[str, Any]] = json.loads(out)
    return rows


def stranded(ctl: Rabbitmqctl, vhost: str) -> list[str]:
    """Queues holding messages ready that no worker consumes (streams, and a scheduler's snapshot
    queue of one message, keep what they hold by design)."""
    return [
        f"{row['name']}={row['messages_ready']}"
        for row in queues(ctl, vhost)
        if row["type"] != "stream"
        and not row["name"].endswith(".snapshot")
        and int(row["messages_ready"] or 0) > 0
        and int(row["consumers"] or 0) == 0
    ]


@pytest.fixture
def rabbitmqctl(session_broker: SessionBroker) -> Rabbitmqctl:
    ctl = session_broker.rabbitmqctl
    assert ctl is not None, (
        "these tests list a vhost's queues with rabbitmqctl, which this broker does not offer"
    )
    return ctl


@pytest.fixture
def vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-apps") as url:
        yield url


def vhost_of(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path[1:])


def test_two_apps_with_a_namespace_each_never_act_on_each_others_state(
    vhost_url: str, rabbitmqctl: Rabbitmqctl, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.jsonl"
    with ExitStack() as stack:
        for app, queues_, namespace in ((SHOP, SHOP_QUEUES, "shop"), (BILLING, BILLING_QUEUES, "billing")):
            worker = WorkerProcess(
                vhost_url,
                app=app,
                queues=queues_,
                concurrency=2,
                extra_args=["-B"],
                env=worker_env(notes, namespace),
            )
            stack.enter_context(worker).wait_ready()
        # A runtime entry for shop's scheduler alone: billing's never reads shop's journal.
        added, _ = run_ctl(
            "schedule", "add", "shop-added", "shop.tick", "--every", "1", "--args", '["added"]',
            "--app-namespace", "shop", "-b", vhost_url,
        )  # fmt: skip
        assert added.returncode == 0, added.stderr
        for app_name in ("shop", "billing"):
            client = stack.enter_context(closing(our_client(vhost_url, app_name, app_name)))
            assert our_chords(client, app_name, 3) == expected(app_name, 3)
            celery = celery_client(vhost_url, app_name, app_name)
            stack.callback(close_celery_client, celery)
            assert celery_chords(celery, app_name, 3) == expected(app_name, 3)
        wanted = {
            ("shop", "shop.tick:configured"),
            ("shop", "shop.tick:added"),
            ("billing", "billing.tick:configured"),
        }
        wait_for(
            lambda: wanted <= set(read_notes(notes)), timeout_s=30, message=f"ticks not all run: {wanted}"
        )
        # Each task ran on its own app's workers (another app's worker would refuse it unregistered).
        assert {app for app, what in read_notes(notes) if not what.startswith(app)} == set()
        for namespace, names in (("shop", {"shop-tick", "shop-added"}), ("billing", {"billing-tick"})):
            listed = ScheduleClient(Settings(broker_url=vhost_url, app_namespace=namespace)).list()
            assert {entry.entry.name for entry in listed} == names
            assert all(entry.last_fired is not None for entry in listed)
        wait_for(
            lambda: not stranded(rabbitmqctl, vhost_of(vhost_url)), timeout_s=20,
            message=f"messages left where nothing consumes: {stranded(rabbitmqctl, vhost_of(vhost_url))}",
        )  # fmt: skip
        names = {row["name"] for row in queues(rabbitmqctl, vhost_of(vhost_url))}
        assert {"clockwork.chords.shop", "clockwork.chords.billing"} <= names
        assert "clockwork.chords.celery" not in names


def test_apps_sharing_the_legacy_namespace_still_get_their_chord_bodies_and_are_warned(
    vhost_url: str, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.jsonl"
    with ExitStack() as stack:
        # billing's worker starts first, so it is the joiner of every chord in the shared namespace.
        billing = stack.enter_context(
            WorkerProcess(
                vhost_url, app=BILLING, queues=BILLING_QUEUES, concurrency=1, env=worker_env(notes, None)
            )
        )
        billing.wait_ready()
        billing.first("chord_joiner_subscribed")
        shop = stack.enter_context(
            WorkerProcess(vhost_url, app=SHOP, queues=SHOP_QUEUES, concurrency=1, env=worker_env(notes, None))
        )
        shop.wait_ready()
        celery = celery_client(vhost_url, "shop", None)
        stack.callback(close_celery_client, celery)
        assert celery_chords(celery, "shop", 2) == expected("shop", 2)
        client = stack.enter_context(closing(our_client(vhost_url, "shop", None)))
        assert our_chords(client, "shop", 2) == expected("shop", 2)
        # billing's worker joined shop's chords (it logs once the body's commit returns: wait for it).
        wait_for(lambda: billing.count("chord_body_sent") == 4, timeout_s=10, message="billing joined 4")
        assert shop.count("chord_body_sent") == 0
        warned = shop.first("app_namespace_shared", timeout_s=30)
        assert warned["namespace"] == "celery" and warned["peer"] == billing.name


def test_while_an_app_moves_to_its_own_namespace_every_chord_joins_in_its_senders(
    vhost_url: str, tmp_path: Path
) -> None:
    # The move of docs/guide.md: a worker still in the legacy namespace beside one in the new,
    # both on shop's queue. A chord's header tasks run on either; its parts all go to the join
    # queue its sender named, so none is split between two joiners.
    notes = tmp_path / "notes.jsonl"
    with ExitStack() as stack:
        for namespace in (None, "shop"):
            worker = WorkerProcess(
                vhost_url, app=SHOP, queues=SHOP_QUEUES, concurrency=1, env=worker_env(notes, namespace)
            )
            stack.enter_context(worker).wait_ready()
        client = stack.enter_context(closing(our_client(vhost_url, "shop", "shop")))
        assert our_chords(client, "shop", 4) == expected("shop", 4)
        celery = celery_client(vhost_url, "shop", "shop")
        stack.callback(close_celery_client, celery)
        assert celery_chords(celery, "shop", 4) == expected("shop", 4)
        ran = [what for _, what in read_notes(notes) if what == "shop.add"]
        assert len(ran) == 24
