"""A chord's body carries its destination, routed by the sending app: the joiner never routes it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from broker_svc import App, Settings, Signature, chord
from broker_svc.wire.records.chord_part import NAMESPACE_KEY, join_namespace


@pytest.fixture
def app():
    app = App("sender", settings=Settings(default_queue="fallback", confirm="pipelined"))
    app.conf.task_routes = {"t.routed": {"queue": "routed"}}
    app.task(name="t.declared", queue="declared")(lambda values: values)
    yield app
    app.close()


def _header_of(app: App, body: Signature) -> list[Signature]:
    """The header tasks ``chord(...)(body)`` hands to ``send_many``: read here, not sent."""
    sent: list[Signature] = []

    def keep(signatures: Iterable[Signature], *, wait: bool = False) -> list[Any]:
        batch = list(signatures)
        sent.extend(batch)
        return [app.AsyncResult(f"part-{i}") for i in range(len(batch))]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app, "send_many", keep)
        chord([app.signature("t.part", (1,))])(body)
    return sent


def _body_queue(app: App, body: str, **options: Any) -> Any:
    return _header_of(app, app.signature(body, **options))[0].options["chord"]["options"].get("queue")


def test_the_body_names_the_senders_namespace_whose_joiner_joins_it():
    app = App("sender", settings=Settings(app_namespace="shop"))
    try:
        body = _header_of(app, app.signature("t.body"))[0].options["chord"]
    finally:
        app.close()
    assert body[NAMESPACE_KEY] == "shop" and join_namespace(body, "celery") == "shop"
    assert join_namespace({}, "celery") == "celery"  # an older client's chord: the worker's own
    assert join_namespace({NAMESPACE_KEY: "no/such name"}, "celery") == "celery"


def test_the_body_carries_the_sending_apps_route(app: App):
    assert _body_queue(app, "t.declared") == "declared"
    assert _body_queue(app, "t.routed") == "routed"
    assert _body_queue(app, "t.unknown.here") == "fallback"
    assert _body_queue(app, "t.declared", queue="explicit") == "explicit"


# Celery 5.7 warns that a task's own ``queue`` goes in 6.0; it still routes by it, as tested here.
@pytest.mark.filterwarnings("ignore::celery.exceptions.CDeprecationWarning")
def test_a_celery_clients_body_carries_its_apps_route():
    from celery import Celery

    from broker_svc.celery_backend import ChordBackend

    client = Celery("sender", broker="memory://", backend="rpc://")
    client.conf.update(task_default_queue="fallback", task_routes={"t.routed": {"queue": "routed"}})

    # shared=False: a shared Celery task joins every Celery app finalized later in this process.
    @client.task(name="t.declared", queue="declared", shared=False)
    def declared(values: list[int]) -> list[int]:
        return values

    backend = ChordBackend(app=client)
    for name, queue in (("t.declared", "declared"), ("t.routed", "routed"), ("t.unknown", "fallback")):
        body = client.signature(name)
        backend.apply_chord(("group-id", [object(), object()]), body)
        assert (body["chord_size"], body.options["queue"], body[NAMESPACE_KEY]) == (2, queue, "celery")
    explicit = client.signature("t.routed", queue="explicit")
    backend.apply_chord(("group-id", [object()]), explicit)
    assert explicit.options["queue"] == "explicit"
