"""Celery's stamping on our canvas: the same stamps as Celery 5.7's, in the same message headers."""

from __future__ import annotations

import json
from typing import Any

import celery.canvas as celery_canvas
import pytest
from celery import Celery

import broker_svc
from broker_svc import App, Settings, Signature
from broker_svc.canvas.follow_ups import follow_ups, unhonoured
from broker_svc.clock import LamportClock
from broker_svc.errors import InvalidTaskMessage
from broker_svc.sending.message import build_message
from broker_svc.tasks.request import Request
from broker_svc.wire import codec
from broker_svc.wire.task.stamps import message_stamps, revoke_headers, task_stamps
from broker_svc.wire.task.task_message import TaskMessage, decode_task, encode_task
from worker.rules.job_request import request_context


@pytest.fixture(scope="module")
def celery_app():
    return Celery("stamps", set_as_current=False)


@pytest.fixture(scope="module")
def app():
    app = App("stamps", settings=Settings(confirm="pipelined"))
    yield app
    app.close()


class _Hooks:
    # One set of hooks for both visitors: each names the part it stamps.
    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"on_sig": sig["task"], "n": 1}

    def on_callback(self, callback: Any, **header: Any) -> dict[str, Any]:
        return {"cb": callback["task"]}

    def on_errback(self, errback: Any, **header: Any) -> dict[str, Any]:
        return {"eb": "y"}

    def on_group_start(self, group: Any, **headers: Any) -> dict[str, Any]:
        return {"grp": "G"}

    def on_chain_start(self, chain: Any, **headers: Any) -> dict[str, Any]:
        return {"chn": "C"}

    def on_chord_body(self, sig: Any, **header: Any) -> dict[str, Any]:
        return {"body": "B"}


class CeleryVisitor(_Hooks, celery_canvas.StampingVisitor):  # type: ignore[misc]
    pass


class OurVisitor(_Hooks, broker_svc.StampingVisitor):
    pass


def _canvases(module: Any, app: Any) -> list[Any]:
    # The same canvases, built by Celery's canvas or ours.
    if module is celery_canvas:

        def sig(name: str, **options: Any) -> Any:
            return celery_canvas.signature(name, app=app, options=options)

        chain, group, chord = celery_canvas.chain, celery_canvas.group, celery_canvas.chord
    else:

        def sig(name: str, **options: Any) -> Any:
            return Signature(name, app=app, **options)

        def chain(*steps: Any) -> Any:
            return broker_svc.chain(*steps, app=app)

        group, chord = broker_svc.group, broker_svc.chord
    linked = sig("a")
    linked.link(sig("cb1"))
    linked.link(sig("cb2"))
    linked.link_error(sig("eb"))
    stamped = sig("b", k="old", stamped_headers=["k"])
    return [
        chain(linked, stamped, sig("c")),
        group(sig("g1"), sig("g2")),
        chord([sig("h1"), sig("h2")], sig("body")),
        sig("plain"),
        sig("b", k="old", stamped_headers=["k"]),
    ]


def _comparable(value: Any) -> Any:
    # Both canvases as plain data: stamp names as a set (Celery's order is a set's), a chord's
    # header as its list of tasks (ours keeps it as a group), arguments left out.
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "stamped_headers" and isinstance(item, list):
                out[key] = sorted(item)
            elif key == "header" and isinstance(item, dict):
                out[key] = _comparable(item["kwargs"]["tasks"])
            elif key != "args":
                out[key] = _comparable(item)
        return out
    if isinstance(value, list | tuple):
        return [_comparable(item) for item in value]
    return value


def _plain(sig: Any) -> Any:
    as_json = json.dumps(sig, default=lambda o: dict(o) if isinstance(o, dict) else list(o))
    return _comparable(json.loads(as_json))


@pytest.mark.parametrize("with_visitor", [False, True])
@pytest.mark.parametrize("append_stamps", [False, True])
@pytest.mark.parametrize("headers", [{}, {"k": "new"}, {"k": ["l1"], "m": 3}])
def test_every_canvas_is_stamped_as_celerys_is(celery_app, app, with_visitor, append_stamps, headers):
    theirs, ours = _canvases(celery_canvas, celery_app), _canvases(broker_svc, app)
    for index, (celery_sig, our_sig) in enumerate(zip(theirs, ours, strict=True)):
        for stamps in (headers, {"k2": "again"}):  # stamped twice: a stamp given again
            celery_sig.stamp(CeleryVisitor() if with_visitor else None, append_stamps, **stamps)
            our_sig.stamp(OurVisitor() if with_visitor else None, append_stamps, **stamps)
        assert _plain(our_sig) == _plain(celery_sig), index


def test_a_chords_body_is_stamped_only_through_a_visitor(app):
    plain = broker_svc.chord([Signature("h", app=app)], Signature("body", app=app))
    plain.stamp(k="v")
    assert plain.body is not None and "stamped_headers" not in plain.body.options
    assert plain.tasks[0].options["k"] == "v"
    visited = broker_svc.chord([Signature("h", app=app)], Signature("body", app=app))
    visited.stamp(OurVisitor(), k="v")
    assert visited.body is not None
    assert visited.body.options["k"] == "v" and visited.body.options["body"] == "B"


def test_a_callback_given_as_a_map_keeps_its_stamps(app):
    sig = Signature("t", app=app, link=[{"task": "cb", "args": [], "kwargs": {}, "options": {}}])
    sig.stamp(k="v")
    assert isinstance(sig.options["link"][0], Signature)
    assert sig.options["link"][0].options["k"] == "v"


def test_the_visitor_base_class_needs_on_signature():
    with pytest.raises(TypeError):
        broker_svc.StampingVisitor()  # type: ignore[abstract]


# -- the message ------------------------------------------------------------------------------------


def _sent_headers(app: App, sig: Signature) -> dict[str, Any]:
    message, _, _ = build_message(
        sig, conf=app.conf, settings=app.settings, clock=LamportClock(), reply_queue="r"
    )
    return encode_task(message, serializer="json").headers


def test_stamps_travel_in_the_headers_celerys_client_puts_them_in(celery_app, app):
    sig = Signature("t.x", app=app)
    sig.stamp(tenant="acme", tags=["a", "b"])
    headers = _sent_headers(app, sig)
    celery_sig = celery_canvas.signature("t.x", app=celery_app)
    celery_sig.stamp(tenant="acme", tags=["a", "b"])
    options = dict(celery_sig.options)
    celery_headers = celery_app.amqp.as_task_v2("id", "t.x", **options).headers
    assert sorted(headers["stamped_headers"]) == sorted(celery_headers["stamped_headers"])
    assert headers["stamps"] == celery_headers["stamps"] == {"tenant": "acme", "tags": ["a", "b"]}
    assert "tenant" not in headers  # a stamp is not a header of its own


def test_an_unstamped_task_carries_celerys_empty_stamps(app):
    headers = _sent_headers(app, Signature("t.x", app=app))
    assert headers["stamped_headers"] is None and headers["stamps"] == {}


def test_stamps_are_given_to_apply_async_as_celerys_are(app):
    headers = _sent_headers(app, Signature("t.x", app=app, stamped_headers=["run"], run=7))
    assert headers["stamped_headers"] == ["run"] and headers["stamps"] == {"run": 7}
    with pytest.raises(TypeError, match="unknown send option"):
        _sent_headers(app, Signature("t.x", app=app, run=7))  # not listed: not a stamp
    with pytest.raises(TypeError, match="stamped_headers"):
        message_stamps({"stamped_headers": "run"})


def test_stamps_round_trip_and_malformed_ones_are_refused():
    message = TaskMessage(id="i", task="t", stamped_headers=["k"], stamps={"k": "v"})
    wire = encode_task(message, serializer="msgpack")
    accept = codec.accept_set(["msgpack"])

    def decode(headers: dict[str, Any]) -> TaskMessage:
        return decode_task(
            wire.body, headers, content_type=wire.content_type, accept=accept, max_bytes=1 << 20
        )

    decoded = decode(wire.headers)
    assert decoded.stamped_headers == ["k"] and decoded.stamps == {"k": "v"}
    assert "stamps" not in decoded.extra_headers
    with pytest.raises(InvalidTaskMessage, match="stamped_headers"):
        decode({**wire.headers, "stamped_headers": "k"})
    with pytest.raises(InvalidTaskMessage, match="stamps"):
        decode({**wire.headers, "stamps": ["v"]})


def test_the_task_sees_its_stamps_as_celerys_request_shows_them():
    message = TaskMessage(id="i", task="t", stamped_headers=["k"], stamps={"k": "v", "other": 1})
    request = Request.from_worker(
        request_context(message, {}, hostname="w"), task="t", args=[], kwargs={}, send_update=None
    )
    assert request.stamped_headers == ["k"] and request.stamps == {"k": "v", "other": 1}
    assert task_stamps(request.stamped_headers, request.stamps) == {"k": "v"}  # the worker reads these
    unstamped = Request.from_worker(
        request_context(TaskMessage(id="i", task="t"), {}, hostname="w"),
        task="t", args=[], kwargs={}, send_update=None,
    )  # fmt: skip
    assert unstamped.stamped_headers is None and unstamped.stamps == {}


def test_follow_ups_keep_the_stamps_of_their_signatures(app):
    step = Signature("t.next", app=app)
    callback = Signature("t.cb", app=app)
    step.link(callback)
    step.stamp(k="v")
    parent = TaskMessage(id="p", task="t.first", reply_to="r")
    sent = follow_ups(step.as_wire(), parent=parent, partial=(1,))
    assert sent[0].message.stamps == {"k": "v"} and sent[0].message.stamped_headers == ["k"]
    assert sent[0].message.embed["callbacks"][0]["options"]["k"] == "v"  # the callback's own, later
    bad = {**step.as_wire(), "options": {"stamped_headers": "k"}}
    assert unhonoured({"chain": [bad]}) is not None  # never sent without its stamps in silence


# -- a revoke's headers -----------------------------------------------------------------------------


def test_revoke_headers_take_celerys_shapes():
    assert revoke_headers({"k": "v", "n": [1, 2]}) == {"k": ["v"], "n": [1, 2]}
    assert revoke_headers(["k=v", "x=a=b"]) == {"k": ["v"], "x": ["a=b"]}  # celery control's form


@pytest.mark.parametrize(
    "headers", ["k=v", 3, None, ["novalue"], {"": "v"}, {"k": {"nested": 1}}, {"k": [None]}, {1: "v"}]
)
def test_malformed_revoke_headers_are_refused(headers):
    with pytest.raises(ValueError):
        revoke_headers(headers)


def test_an_eager_run_sees_its_stamps_as_celerys_eager_request(app):
    seen: dict[str, Any] = {}

    @app.task(name="t.stamped.eager", bind=True)
    def look(self: Any) -> None:
        seen.update(stamped_headers=self.request.stamped_headers, stamps=self.request.stamps)

    sig = look.s()
    sig.stamp(k="v")
    sig.apply()
    assert seen == {"stamped_headers": ["k"], "stamps": {"k": ["v"]}}


def test_a_calls_options_do_not_override_stamps_or_the_group_id_as_celerys_merge(celery_app, app):
    ours = Signature("t.x", app=app)
    ours.stamp(tenant="acme")
    ours.set(group_id="g1", queue="q1")
    theirs = celery_canvas.signature("t.x", app=celery_app)
    theirs.stamp(tenant="acme")
    theirs.set(group_id="g1", queue="q1")
    given = {"tenant": "other", "group_id": "g2", "queue": "q2", "priority": 3}
    merged = ours._merged(given)
    expected = theirs._merge(options=given)[2]
    assert {k: merged[k] for k in given} == {k: expected[k] for k in given}
    assert (merged["tenant"], merged["group_id"], merged["queue"]) == ("acme", "g1", "q2")
