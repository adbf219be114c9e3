"""Our client's canvas on the wire: what a chain, a group, callbacks and chunks send, read off the queue.

The messages must be what Celery's client sends (WIRE.md §3.3), so both our worker and a Celery
worker run them; the end-to-end runs are in tests/interop/test_canvas_end_to_end.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from broker_svc import App, AsyncResult, Settings, chain, chord, group
from broker_svc.errors import PublishError, Unroutable
from tests.support.amqp import Got, channel, delete_queues, drain
from tests.support.waiting import wait_for
from tests.support.workers import unique_queue

ADD = "tests.integration.e2e_tasks.add"


@pytest.fixture
def client(test_vhost_url: str) -> Iterator[tuple[App, str]]:
    queue = unique_queue("canvas")
    app = App("canvas", settings=Settings(broker_url=test_vhost_url, serializer="json", default_queue=queue))
    app.task(name=ADD)(lambda x, y: x + y)
    try:
        yield app, queue
    finally:
        app.close()
        delete_queues(test_vhost_url, queue)


def _sent(app: App, url: str, queue: str, count: int) -> list[tuple[dict, list]]:
    app.flush(10)  # confirmed: declared and in the queue
    got: list[Got] = []

    def arrived() -> bool:
        got.extend(drain(url, queue))
        return len(got) >= count

    wait_for(arrived, timeout_s=10, message="not sent")
    return [(m.headers, json.loads(m.body)) for m in got]


def test_a_chain_sends_its_first_step_carrying_the_rest_last_first(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    result = chain(add.s(1, 2), add.s(3), add.si(10, 20)).apply_async()
    assert isinstance(result, AsyncResult)
    [(headers, (args, kwargs, embed))] = _sent(app, test_vhost_url, queue, 1)
    assert (headers["task"], args, kwargs) == (ADD, [1, 2], {})
    rest = embed["chain"]
    assert [step["args"] for step in rest] == [[10, 20], [3]]  # reversed: the next step is last
    assert [step["immutable"] for step in rest] == [True, False]
    assert rest[0]["options"]["task_id"] == result.id  # the call returns the last step's result
    middle = result.parent
    assert isinstance(middle, AsyncResult) and rest[1]["options"]["task_id"] == middle.id
    assert middle.parent is not None and middle.parent.id == headers["id"]
    assert {step["options"]["reply_to"] for step in rest} == {app.reply_queue}
    assert {step["options"]["root_id"] for step in rest} == {headers["id"]}
    assert (embed["callbacks"], embed["errbacks"], embed["chord"]) == (None, None, None)


def test_pipes_flatten_into_one_chain_and_partial_arguments_go_first(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    (add.s(2) | add.s(3) | (add.s(4) | add.s(5))).apply_async((1,))
    [(_, (args, _, embed))] = _sent(app, test_vhost_url, queue, 1)
    assert args == [1, 2]
    assert [step["args"] for step in embed["chain"]] == [[5], [4], [3]]


def test_a_group_sends_each_member_with_its_id_and_index(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    result = group(add.s(i, i) for i in range(3)).apply_async()
    sent = sorted(_sent(app, test_vhost_url, queue, 3), key=lambda m: m[0]["group_index"])
    assert [body[0] for _, body in sent] == [[0, 0], [1, 1], [2, 2]]
    assert {headers["group"] for headers, _ in sent} == {result.id}
    assert [getattr(r, "id", None) for r in result.results] == [headers["id"] for headers, _ in sent]


def test_link_and_link_error_travel_as_callbacks_and_errbacks(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    add.apply_async((1, 1), link=add.s(10), link_error=[add.si(0, 0), add.si(9, 9)])
    [(_, (_, _, embed))] = _sent(app, test_vhost_url, queue, 1)
    assert [(c["task"], c["args"]) for c in embed["callbacks"]] == [(ADD, [10])]
    assert [e["args"] for e in embed["errbacks"]] == [[0, 0], [9, 9]]


def test_chunks_send_a_group_of_starmaps_and_map_sends_one_task(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    add.chunks(zip(range(5), range(5), strict=True), 2).apply_async()
    sent = _sent(app, test_vhost_url, queue, 3)
    assert {headers["task"] for headers, _ in sent} == {"celery.starmap"}
    parts = sorted(kwargs["it"] for _, (_, kwargs, _) in sent)
    assert parts == [[[0, 0], [1, 1]], [[2, 2], [3, 3]], [[4, 4]]]
    add.map([1, 2]).apply_async()
    [(headers, (_, kwargs, _))] = _sent(app, test_vhost_url, queue, 1)
    assert (headers["task"], kwargs["task"]["task"], kwargs["it"]) == ("celery.map", ADD, [1, 2])


def test_a_chord_sends_its_header_each_carrying_the_body_and_the_chord_size(client, test_vhost_url: str):
    app, queue = client
    add = app.tasks[ADD]
    result = (group(add.s(1, 1), add.s(2, 2)) | add.s(3)).apply_async()
    sent = sorted(_sent(app, test_vhost_url, queue, 2), key=lambda m: m[0]["group_index"])
    assert [body[0] for _, body in sent] == [[1, 1], [2, 2]]
    assert result.parent is not None and {h["group"] for h, _ in sent} == {result.parent.id}
    carried = [embed["chord"] for _, (_, _, embed) in sent]
    assert carried[0] == carried[1]
    assert (carried[0]["task"], carried[0]["args"], carried[0]["chord_size"]) == (ADD, [3], 2)
    options = carried[0]["options"]
    assert (options["task_id"], options["reply_to"], options["queue"]) == (result.id, app.reply_queue, queue)


def test_what_cannot_be_sent_is_refused_at_the_call(client):
    app, _queue = client
    add = app.tasks[ADD]
    with pytest.raises(ValueError, match="needs a body"):
        chord([add.s(1, 1)]).apply_async()
    with pytest.raises(TypeError, match="exchange's name"):
        add.apply_async((1, 1), exchange=object(), routing_key="video")


def test_exchange_sends_to_that_exchange_with_the_routing_key(client, test_vhost_url: str):
    """Celery's ``exchange=``/``routing_key=`` (a topic route): the broker routes it; nothing declared."""
    app, _queue = client
    add = app.tasks[ADD]
    exchange, queue = unique_queue("media"), unique_queue("video")
    with channel(test_vhost_url) as ch:
        ch.exchange_declare(exchange, exchange_type="topic", durable=False, auto_delete=True)
        ch.queue_declare(queue, auto_delete=True)
        ch.queue_bind(queue, exchange, routing_key="video.#")
    try:
        sent = add.apply_async((1, 1), exchange=exchange, routing_key="video.hd")
        app.flush(10)
        assert sent.publish_error is None
        got = wait_for(lambda: drain(test_vhost_url, queue), timeout_s=10, message="not routed")
        assert [json.loads(m.body)[0] for m in got] == [[1, 1]]
        # A key nothing is bound for is returned, and an exchange nobody declared closes the
        # channel: both fail the send with Unroutable instead of losing it.
        unbound = add.apply_async((2, 2), exchange=exchange, routing_key="audio.mp3")
        missing = add.apply_async((3, 3), exchange=unique_queue("nowhere"), routing_key="x")
        with pytest.raises(PublishError):
            app.flush(10)
        assert isinstance(unbound.publish_error, Unroutable)
        assert isinstance(missing.publish_error, Unroutable) and "no exchange" in str(missing.publish_error)
        # The client goes on sending after the closed channel.
        assert add.apply_async((4, 4), exchange=exchange, routing_key="video.sd").publish_error is None
        app.flush(10)
        assert len(wait_for(lambda: drain(test_vhost_url, queue), timeout_s=10, message="lost")) == 1
    finally:
        delete_queues(test_vhost_url, queue)
