"""Keyed deduplication on the client: the task option checked at declaration, each send's key."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker_svc import App, Settings, Task, chain, chord, group
from broker_svc.canvas.signature import Signature
from broker_svc.connection.pending import prepare_publish
from broker_svc.schedules.entry import Entry
from broker_svc.schedules.interval import Every
from broker_svc.sending.capture import SendCapture, capturing
from broker_svc.sending.dedup_keys import KEY_MAX_BYTES, TaskDedup, check_dedup_key, dedup_call
from broker_svc.sending.message import Destination, build_message
from broker_svc.spool.entry import spooled_of, template_of
from broker_svc.topology import LEGACY_NAMESPACE, dedup_gate_queue
from broker_svc.wire.records.dedup import (
    DEADLINE_HEADER,
    DEFAULT_DEDUP_TIMEOUT_S,
    KEY_HEADER,
    MAX_DEDUP_TIMEOUT_S,
    TARGET_QUEUE_HEADER,
    TIMEOUT_HEADER,
    shard_of,
)
from broker_svc.wire.task.task_message import TaskMessage, encode_task


@pytest.fixture
def app() -> Iterator[App]:
    app = App("dk", settings=Settings(), set_as_current=False)
    yield app
    app.close()


@pytest.fixture
def capture() -> Iterator[SendCapture]:
    # What the app would send, kept instead (as the asyncio client keeps it): no broker needed.
    with capturing("reply") as kept:
        yield kept


def _sent(capture: SendCapture) -> list[dict[str, Any]]:
    return [sig.options for sig in capture.kept]


# -- the task option, at declaration -----------------------------------------------------------------


def test_an_argument_name_gives_the_same_key_positionally_and_by_keyword(app: App, capture: SendCapture):
    @app.task(name="users.refresh", dedup_key="user_id")
    def refresh(user_id: int, force: bool = False) -> None: ...

    refresh.delay(42)
    refresh.delay(user_id=42)
    refresh.apply_async((42,), {"force": True})
    assert [o["dedup_key"] for o in _sent(capture)] == ["users.refresh:42"] * 3
    assert {o["dedup_timeout"] for o in _sent(capture)} == {DEFAULT_DEDUP_TIMEOUT_S}


def test_an_argument_left_to_its_default_gives_the_key_of_the_default(app: App, capture: SendCapture):
    @app.task(name="t.page", dedup_key="page")
    def page(site: str, page: int = 1) -> None: ...

    page.delay("a")
    page.delay("a", page=2)
    assert [o["dedup_key"] for o in _sent(capture)] == ["t.page:1", "t.page:2"]


def test_two_tasks_with_equal_arguments_do_not_share_a_key(app: App, capture: SendCapture):
    @app.task(name="t.one", dedup_key="n")
    def one(n: int) -> None: ...

    @app.task(name="t.two", dedup_key="n")
    def two(n: int) -> None: ...

    one.delay(7)
    two.delay(7)
    assert [o["dedup_key"] for o in _sent(capture)] == ["t.one:7", "t.two:7"]


def test_a_callable_takes_the_calls_arguments_and_its_value_is_prefixed(app: App, capture: SendCapture):
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return f"{args[0]}/{kwargs.get('region', 'eu')}"

    @app.task(name="t.report", dedup_key=key, dedup_timeout=30)
    def report(account: str, region: str = "eu") -> None: ...

    report.delay("acme", region="us")
    [sent] = _sent(capture)
    assert (sent["dedup_key"], sent["dedup_timeout"]) == ("t.report:acme/us", 30.0)
    assert seen == [(("acme",), {"region": "us"})]
    assert report.dedup_key is key  # a plain function on the task, not a bound method


def test_a_bound_task_binds_the_key_after_the_task_itself(app: App, capture: SendCapture):
    @app.task(name="t.bound", bind=True, dedup_key="user_id")
    def bound(self: Task, user_id: int) -> None: ...

    bound.delay(5)
    bound.delay(user_id=5)
    assert [o["dedup_key"] for o in _sent(capture)] == ["t.bound:5", "t.bound:5"]
    with pytest.raises(TypeError, match="'self' is not one of its arguments"):
        app.task(name="t.self", bind=True, dedup_key="self")(lambda self, user_id: None)


def test_a_base_class_can_give_its_tasks_a_key(app: App, capture: SendCapture):
    class Keyed(Task):
        dedup_key = "tenant"
        dedup_timeout = 45.0

    @app.task(name="t.sync", base=Keyed)
    def sync(tenant: str) -> None: ...

    sync.delay("t1")
    assert _sent(capture)[0]["dedup_key"] == "t.sync:t1"
    assert _sent(capture)[0]["dedup_timeout"] == 45.0


def _refresh(user_id: int, force: bool = False, *rest: Any, **extra: Any) -> None: ...


@pytest.mark.parametrize(
    ("dedup_key", "match"),
    [
        ("nope", r"dedup_key='nope' is not one of its arguments \['user_id', 'force', 'rest', 'extra'\]"),
        ("", "is not one of its arguments"),
        ("rest", r"names its \*args or \*\*kwargs"),
        ("extra", r"names its \*args or \*\*kwargs"),
        (5, "must be an argument's name or a callable"),
    ],
)
def test_a_key_naming_no_argument_is_refused_at_declaration(app: App, dedup_key: object, match: str):
    with pytest.raises(TypeError, match=match) as caught:
        app.task(name="t.declared", dedup_key=dedup_key)(_refresh)
    assert "'t.declared'" in str(caught.value)
    assert "t.declared" not in app.tasks


OUT_OF_RANGE = [0, -1, MAX_DEDUP_TIMEOUT_S + 1, float("nan"), float("inf"), True, "30"]


@pytest.mark.parametrize("timeout", OUT_OF_RANGE)
def test_a_timeout_out_of_range_is_refused(app: App, timeout: object):
    with pytest.raises(ValueError, match=r"'t.timed'.*dedup_timeout must be seconds, above 0 and at most"):
        app.task(name="t.timed", dedup_key="x", dedup_timeout=timeout)(lambda x: x)
    with pytest.raises(ValueError, match="dedup_timeout must be seconds"):
        dedup_call("t.any", {"dedup_key": "k", "dedup_timeout": timeout})


def test_a_timeout_of_up_to_the_maximum_is_kept_as_float_seconds(app: App, capture: SendCapture):
    @app.task(name="t.max", dedup_key="x", dedup_timeout=int(MAX_DEDUP_TIMEOUT_S))
    def capped(x: int) -> None: ...

    capped.delay(1)
    capped.apply_async((1,), dedup_timeout=0.5)
    assert [o["dedup_timeout"] for o in _sent(capture)] == [MAX_DEDUP_TIMEOUT_S, 0.5]
    assert all(type(o["dedup_timeout"]) is float for o in _sent(capture))


# -- a send's own key ---------------------------------------------------------------------------------


def test_a_calls_key_is_used_as_it_is_and_wins_over_the_tasks(app: App, capture: SendCapture):
    @app.task(name="t.keyed", dedup_key="n", dedup_timeout=20)
    def keyed(n: int) -> None: ...

    keyed.apply_async((1,), dedup_key="literal-key")
    keyed.apply_async((1,), dedup_key="literal-key", dedup_timeout=3)
    app.send_task("t.keyed", (9,))  # by name: a task registered here still forms its key
    app.send_task("elsewhere.task", (1,), dedup_key="other")  # not registered here: a literal key
    sent = _sent(capture)
    assert [(o["dedup_key"], o["dedup_timeout"]) for o in sent] == [
        ("literal-key", 20.0),
        ("literal-key", 3.0),
        ("t.keyed:9", 20.0),
        ("other", DEFAULT_DEDUP_TIMEOUT_S),
    ]


def test_sends_without_a_key_are_left_as_they_are(app: App, capture: SendCapture):
    @app.task(name="t.plain")
    def plain(n: int) -> None: ...

    plain.delay(1)
    assert "dedup_key" not in _sent(capture)[0] and "dedup_timeout" not in _sent(capture)[0]


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("", "a dedup key must be a non-empty str"),
        (b"bytes", "a dedup key must be a non-empty str"),
        (42, "a dedup key must be a non-empty str"),
        ("é" * 101, "is 202 bytes in UTF-8, over 200"),
        ("\ud800", "not valid text"),
    ],
)
def test_a_calls_key_must_be_a_short_non_empty_str(app: App, capture: SendCapture, key: object, match: str):
    with pytest.raises(ValueError, match=rf"task 't.named': .*{match}"):
        app.send_task("t.named", dedup_key=key)
    assert capture.kept == []


def test_a_key_of_exactly_the_limit_is_accepted():
    assert check_dedup_key("é" * (KEY_MAX_BYTES // 2), "t") == "é" * 100


def test_a_formed_key_over_the_limit_names_the_task(app: App, capture: SendCapture):
    @app.task(name="t.long", dedup_key="text")
    def long(text: str) -> None: ...

    long.delay("x" * (KEY_MAX_BYTES - len("t.long:")))
    with pytest.raises(ValueError, match="task 't.long': the dedup key .* is 201 bytes"):
        long.delay("x" * (KEY_MAX_BYTES - len("t.long:") + 1))
    assert len(capture.kept) == 1


def test_a_timeout_without_a_key_is_refused(app: App, capture: SendCapture):
    @app.task(name="t.timeout_only", dedup_timeout=10)
    def timeout_only(n: int) -> None: ...

    timeout_only.delay(1)  # a task's own timeout alone is only the default for its calls' keys
    timeout_only.apply_async((1,), dedup_key="k")
    with pytest.raises(TypeError, match="dedup_timeout without a dedup_key"):
        app.send_task("t.other", dedup_timeout=5)
    assert [o.get("dedup_key") for o in _sent(capture)] == [None, "k"]
    assert _sent(capture)[1]["dedup_timeout"] == 10.0


def test_arguments_that_give_no_key_are_a_type_error_naming_the_task(app: App, capture: SendCapture):
    @app.task(name="t.loose", dedup_key="user_id", typing=False)
    def loose(user_id: int) -> None: ...

    with pytest.raises(TypeError, match="task 't.loose': no dedup key \\('user_id'\\)"):
        loose.apply_async(())


def test_a_key_spec_reads_as_keyed_only_with_a_key():
    assert not TaskDedup("t", timeout_s=5.0).keyed
    assert TaskDedup("t", function=str).keyed
    assert TaskDedup("t", function=str).key((1,), {}) == "t:1"


# -- canvases: a key is honoured only on what the client itself sends ----------------------------------


@pytest.fixture
def tasks(app: App) -> dict[str, Task]:
    @app.task(name="c.keyed", dedup_key="n")
    def keyed(n: int) -> int:
        return n

    @app.task(name="c.plain")
    def plain(n: int = 0) -> int:
        return n

    return {"keyed": keyed, "plain": plain}


def test_a_chains_first_step_and_a_groups_members_keep_their_keys(
    tasks: dict[str, Task], capture: SendCapture
):
    keyed, plain = tasks["keyed"], tasks["plain"]
    chain(keyed.s(1), plain.s()).apply_async()
    group(keyed.s(2), plain.s(3).set(dedup_key="lit")).apply_async()
    assert [o.get("dedup_key") for o in _sent(capture)] == ["c.keyed:1", "c.keyed:2", "lit"]


@pytest.mark.parametrize(
    ("build", "place"),
    [
        (lambda k, p: chain(p.s(1), k.s()), "a chain's step after 'c.plain'"),
        (lambda k, p: chain(p.s(1), p.s().set(dedup_key="x")), "a chain's step after"),
        (lambda k, p: chain(p.s(1), group(k.s(1), p.s(2)), p.s()), "a chain's step after"),
        (lambda k, p: p.s(1).set(link=k.s()), "a callback \\(link\\) of 'c.plain'"),
        (lambda k, p: p.s(1).set(link_error=p.si(2).set(dedup_timeout=9)), "an errback \\(link_error\\) of"),
        (lambda k, p: p.s(1).set(link=p.s().set(link=k.s())), "a callback \\(link\\) of"),
        (lambda k, p: chord([p.s(1), p.s(2)], k.s()), "the chord's body after 'c.plain'"),
        (lambda k, p: chain(p.s(1), chord([p.s(), p.s()], p.s()), k.s()), "a chain's step after"),
    ],
)
def test_a_key_where_a_worker_sends_the_task_later_is_a_type_error(
    tasks: dict[str, Task], capture: SendCapture, build: Any, place: str
):
    with pytest.raises(TypeError, match=rf"has a dedup key, but as {place}.*only tasks a client sends"):
        build(tasks["keyed"], tasks["plain"]).apply_async()
    assert capture.kept == []  # refused before anything is sent


def test_a_chords_header_task_cannot_have_a_key(tasks: dict[str, Task], capture: SendCapture):
    with pytest.raises(TypeError, match="a chord's header task cannot have a dedup key"):
        chord([tasks["plain"].s(1), tasks["keyed"].s(2)], tasks["plain"].s()).apply_async()
    assert capture.kept == []


def test_eager_mode_runs_the_task_and_ignores_its_key():
    eager = App("eager", settings=Settings(), task_always_eager=True, set_as_current=False)

    @eager.task(name="e.keyed", dedup_key="n")
    def keyed(n: int) -> int:
        return n * 2

    assert keyed.delay(2).get() == 4
    assert keyed.apply_async((3,), dedup_key="k", dedup_timeout=1).get() == 6
    eager.close()


def test_a_signature_resolved_again_keeps_its_key(app: App, capture: SendCapture):
    # A formed key is a literal from then on: a signature sent twice is not prefixed twice.
    @app.task(name="t.again", dedup_key="n")
    def again(n: int) -> None: ...

    sig = Signature("t.again", (1,), {}, {"dedup_key": "t.again:1"})
    app.send_many([sig, sig])
    assert [o["dedup_key"] for o in _sent(capture)] == ["t.again:1", "t.again:1"]


# -- on the wire: the message, its headers and where it is published ----------------------------------


def _built(app: App, sig: Signature) -> tuple[TaskMessage, Destination]:
    message, destination, _ = build_message(
        sig, conf=app.conf, settings=app.settings, clock=app.clock, reply_queue="reply"
    )
    return message, destination


def test_a_keyed_message_carries_the_gates_headers_with_its_target_queue(app: App):
    sig = Signature("t.x", (1,), {}, {"queue": "work", "dedup_key": "k1", "dedup_timeout": 30.0})
    message, destination = _built(app, sig)
    assert destination == Destination("work")
    assert message.extra_headers == {KEY_HEADER: "k1", TIMEOUT_HEADER: 30, TARGET_QUEUE_HEADER: "work"}
    routed, _ = _built(app, Signature("t.x", (), {}, {"dedup_key": "k1"}))
    assert routed.extra_headers[TARGET_QUEUE_HEADER] == app.settings.default_queue
    assert routed.extra_headers[TIMEOUT_HEADER] == DEFAULT_DEDUP_TIMEOUT_S


def test_the_timeout_travels_as_whole_seconds_rounded_up(app: App):
    # AMQP headers carry no portable float (pika refuses them; pamqp sends 32 bits).
    message, _ = _built(app, Signature("t.x", (), {}, {"dedup_key": "k", "dedup_timeout": 0.2}))
    assert message.extra_headers[TIMEOUT_HEADER] == 1 and type(message.extra_headers[TIMEOUT_HEADER]) is int
    wire = encode_task(message, serializer="json")
    assert wire.headers[TIMEOUT_HEADER] == 1


def test_a_parents_dedup_headers_do_not_ride_along_on_a_task_it_sends(app: App):
    inherited = {KEY_HEADER: "parent", TIMEOUT_HEADER: 5.0, DEADLINE_HEADER: 1e9, "tenant": "acme"}
    plain, _ = _built(app, Signature("t.x", (), {}, {"headers": inherited}))
    assert plain.extra_headers == {"tenant": "acme"}
    keyed, _ = _built(app, Signature("t.x", (), {}, {"headers": inherited, "dedup_key": "child"}))
    assert keyed.extra_headers[KEY_HEADER] == "child" and DEADLINE_HEADER not in keyed.extra_headers


def test_a_keyed_send_to_a_named_exchange_is_a_type_error(app: App):
    with pytest.raises(TypeError, match="dedup_key sends to a queue, not to a named exchange"):
        _built(app, Signature("t.x", (), {}, {"exchange": "topic", "routing_key": "a.b", "dedup_key": "k"}))


def test_a_keyed_task_is_published_to_its_gate_shard_never_to_a_delay_queue(app: App):
    eta = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=10)
    sig = Signature("t.x", (), {}, {"queue": "work", "dedup_key": "k1", "eta": eta})
    message, (queue, exchange) = _built(app, sig)
    pending = prepare_publish(message, settings=app.settings, clock=app.clock, queue=queue, exchange=exchange)
    gate = dedup_gate_queue(shard_of("k1"), LEGACY_NAMESPACE)
    assert (pending.exchange, pending.routing_key, pending.queue) == ("", gate.name, gate.name)
    assert pending.declare == (gate, app.settings.task_queue("work"))  # the shard, then the target
    assert pending.eta_s is None  # its worker holds the ETA, after the gate
    pending.route(time.time())
    assert pending.routing_key == gate.name
    assert pending.property_fields()["headers"][KEY_HEADER] == "k1"
    with pytest.raises(TypeError, match="not to a named exchange"):
        prepare_publish(message, settings=app.settings, clock=app.clock, queue=queue, exchange="topic")


def test_a_spooled_keyed_task_read_back_declares_its_gate_shard_as_the_gate_does(app: App):
    message, (queue, _) = _built(app, Signature("t.x", (), {}, {"dedup_key": "k1"}))
    pending = prepare_publish(message, settings=app.settings, clock=app.clock, queue=queue)
    replayed = template_of(spooled_of(pending), settings=app.settings)
    assert replayed.declare == (dedup_gate_queue(shard_of("k1"), LEGACY_NAMESPACE),)
    assert replayed.routing_key == pending.routing_key


def test_a_beat_entry_cannot_take_a_dedup_key():
    with pytest.raises(ValueError, match="entry 'nightly': a beat entry cannot take dedup_key"):
        Entry(name="nightly", task="t.x", schedule=Every(60), options={"dedup_key": "k"})


def test_a_keyed_task_cannot_also_wait_for_dependencies():
    jobs_app = App("jobs", settings=Settings(task_states=True), set_as_current=False)

    @jobs_app.task(name="j.keyed", dedup_key="n")
    def keyed(n: int) -> None: ...

    with pytest.raises(TypeError, match="'j.keyed' has a dedup_key: depends_on cannot hold it back too"):
        jobs_app.enqueue(keyed, 1, depends_on=["other-task-id"])
    jobs_app.close()


def test_an_eta_too_far_for_the_gate_to_hold_its_head_is_refused(app: App):
    far = {"queue": "work", "dedup_key": "k1", "countdown": 1000, "dedup_timeout": 600}
    with pytest.raises(ValueError, match="consumer_timeout"):
        _built(app, Signature("t.x", (), {}, far))
    _built(app, Signature("t.x", (), {}, {**far, "countdown": 800}))  # 800 + 600 <= 1500
