"""Chords on RabbitMQ alone: our client's chord run by our workers, the body sent exactly once.

The header's parts are counted in the join queue by one worker of the cluster at a time
(worker/single_active/chord_join.py). These tests run chords end to end, fail a header task, and make
the joiner fail over with parts held and copies of parts sent, counting the body's runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from broker_svc import App, AsyncResult, ChordError, Settings, Signature, chain, chord, group
from broker_svc.topology import LEGACY_NAMESPACE, chord_join_queue
from broker_svc.wire.records.chord_part import ChordPart, encode_part
from tests.infra.session_broker import SessionBroker
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.integration.canvas_tasks:app"


@pytest.fixture(scope="module")
def notes_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chords") / "notes.jsonl"


@pytest.fixture(scope="module")
def chord_url(session_broker: SessionBroker) -> Iterator[str]:
    # A vhost of this module's own: its workers are the only joiners of its chords.
    with session_broker.own_vhost("clockwork-chord") as url:
        yield url


@pytest.fixture(scope="module")
def worker(chord_url: str, notes_path: Path) -> Iterator[WorkerProcess]:
    name = unique_queue("chord")
    env = {"CANVAS_NOTES": str(notes_path)}
    notes_path.unlink(missing_ok=True)
    with WorkerProcess(chord_url, app=APP, queues=[name], concurrency=2, env=env) as process:
        process.wait_ready()
        yield process


@pytest.fixture
def queue(worker: WorkerProcess) -> str:
    return worker.queues[0]


@pytest.fixture
def client(chord_url: str) -> Iterator[App]:
    app = App("chord-client", settings=Settings(broker_url=chord_url, serializer="json"))
    yield app
    app.close()


def _sig(
    client: App, queue: str, name: str, *args: Any, label: str | None = None, **options: Any
) -> Signature:
    kwargs = {"label": label} if label is not None else {}
    return client.signature(f"canvas.{name}", args, kwargs, queue=queue, **options)


def _body_runs(notes_path: Path, label: str) -> list[list[Any]]:
    if not notes_path.exists():
        return []
    runs = []
    for line in notes_path.read_text().splitlines():
        kind, detail = json.loads(line)
        if kind == "collect" and detail[0] == label:
            runs.append(detail[1])
    return runs


def test_a_chord_runs_its_body_once_with_the_header_results_in_order(
    client: App, queue: str, notes_path: Path
):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    # Later members finish first (the sleeps), yet the body sees the header's order.
    header = [s("slow_add", i, i, 0.3 - i * 0.1) for i in range(3)]
    result = chord(header)(s("collect", label="ordered"))
    assert result.get(timeout=30) == [0, 2, 4]
    assert result.parent is not None and result.parent.get(timeout=10) == [0, 2, 4]
    wait_for(lambda: _body_runs(notes_path, "ordered"), timeout_s=10, message="body not noted")
    assert _body_runs(notes_path, "ordered") == [[0, 2, 4]]


def test_group_piped_into_a_task_is_a_chord_and_partial_arguments_reach_the_header(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    assert (group(s("add", i) for i in range(4)) | s("xsum")).apply_async((10,)).get(timeout=30) == 46
    assert chord([s("mul", 2, 3)], s("xsum")).apply_async().get(timeout=30) == 6
    assert chord([], s("collect", label="empty")).apply_async().get(timeout=30) == []


def test_a_chain_through_a_group_runs_the_steps_after_it_with_the_body_result(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    # add(1, 1) -> [add(2, 10), add(2, 20)] -> xsum -> mul(x, 3)
    result = chain(s("add", 1, 1), group(s("add", 10), s("add", 20)), s("xsum"), s("mul", 3)).apply_async()
    assert result.get(timeout=30) == (12 + 22) * 3


def test_a_task_body_calls_a_chain_a_group_and_a_chord_as_celerys_do(
    client: App, queue: str, notes_path: Path
):
    # chain(...)() and group(...)() send them (Celery's __call__), from inside a running task too.
    sent = client.send_task("canvas.spawn_canvas", (queue, "spawned"), queue=queue).get(timeout=30)
    assert set(sent) == {"chain", "group", "members", "chord"} and sent["members"] == 3
    # The chain is three hops in a row, the chord two: neither is bound to finish first.
    wait_for(lambda: _body_runs(notes_path, "spawned-chain"), timeout_s=20, message="the chain ended")
    wait_for(lambda: _body_runs(notes_path, "spawned-chord"), timeout_s=20, message="the chord's body ran")
    wait_for(lambda: len(_body_runs(notes_path, "spawned-group")) == 3, timeout_s=20, message="the group ran")
    assert _body_runs(notes_path, "spawned-chain") == [4]  # type: ignore[comparison-overlap]  # collect(4)
    assert _body_runs(notes_path, "spawned-chord") == [[0, 2, 4]]
    assert sorted(_body_runs(notes_path, "spawned-group")) == [0, 1, 2]  # type: ignore[comparison-overlap]


def test_a_header_of_chains_groups_and_chords_joins_with_one_value_per_member(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    # As Celery's workers give it: a chain's last value, a group unrolled (its members reversed, as
    # Celery's client unrolls them), an inner chord's body value, a chain's closing group as a list.
    header = [
        s("add", 1, 0),
        chain(s("add", 2, 0), s("mul", 10)),
        group(s("add", 3, 0), s("add", 4, 0)),
        chord([s("add", 5, 0), s("add", 6, 0)], s("xsum")),
        chain(s("add", 7, 0), chord([s("add", 1), s("add", 2)], s("xsum"))),
    ]
    result = chord(header)(s("collect", label="nested"))
    assert result.get(timeout=30) == [1, 20, 4, 3, 11, 17]
    shapes = [
        chain(s("add", 8, 0), group(s("add", 1), s("add", 2))),
        group(group(s("add", 1, 0)), s("add", 9, 0)),
    ]
    assert chord(shapes)(s("collect")).get(timeout=30) == [[9, 10], 9, 1]
    deep = chord(
        [chord([chord([s("add", 1, 1), s("add", 2, 2)], s("xsum")), s("add", 3, 3)], s("xsum"))], s("xsum")
    )
    assert deep.apply_async().get(timeout=30) == 12


def test_a_failure_inside_a_nested_chord_fails_the_outer_body_with_a_chord_error(client: App, queue: str):
    # Celery's workers leave the outer chord waiting forever; here the inner chord's failure is its
    # part, so the outer body fails too, naming the inner body and the first cause.
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    inner = chord([s("add", 1), s("fail", 3)], s("xsum"))
    result = chord([s("add", 2, 2), chain(s("add", 1, 0), inner)])(s("collect", label="never-nested"))
    with pytest.raises(
        ChordError, match=r"Dependency .* raised ChordError\(.*Dependency .* raised ValueError"
    ):
        result.get(timeout=30)
    failed_in_chain = chord([s("add", 1, 1), chain(s("add", 1, 0), s("fail"))])(s("collect"))
    with pytest.raises(ChordError, match=r"raised ValueError"):
        failed_in_chain.get(timeout=30)


def test_a_header_task_adds_tasks_to_its_chord_and_the_body_waits_for_them(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    # Each added task's value comes right after its adder's, in the order added.
    result = chord([s("grow", 1, [100, 200]), s("add", 2, 0), s("grow", 3, [300])])(s("collect"))
    assert result.get(timeout=30) == [1, 101, 201, 2, 3, 303]
    lazy = chord([s("grow", 5, [10], True), s("add", 6, 0)])(s("collect"))
    assert lazy.get(timeout=30) == [5, 15, 6]
    # An added task that fails fails the chord, as a header task does.
    failing = chord([s("grow", 1, ["not a number"])])(s("collect"))
    with pytest.raises(ChordError, match=r"raised TypeError"):
        failing.get(timeout=30)
    with pytest.raises(ValueError, match="not member of any chord"):
        client.send_task("canvas.grow", (1, [2]), queue=queue).get(timeout=30)


def test_a_failed_header_task_fails_the_body_with_a_chord_error_and_never_runs_it(
    client: App, worker: WorkerProcess, queue: str, notes_path: Path
):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    errback = s("note")
    result = chord([s("add", 1, 1), s("fail", 7), s("slow_add", 2, 2, 1.0)])(
        s("collect", label="never", link_error=[errback])
    )
    started = time.monotonic()
    with pytest.raises(ChordError, match=r"Dependency .* raised ValueError"):
        result.get(timeout=30)
    # Told at the failure, not after the slow member: no waiting for the whole header.
    assert time.monotonic() - started < 5
    wait_for(
        lambda: any(
            json.loads(line) == ["note", [result.id]] for line in notes_path.read_text().splitlines()
        ),
        timeout_s=10,
        message="the body's errback did not run with the body's id",
    )
    group_id = result.parent.id if result.parent is not None else None

    def settled() -> bool:  # the slow member ended too, and its part did not run the body
        return any(
            e.get("event") == "chord_settled" and e.get("group_id") == group_id for e in worker.events()
        )

    wait_for(settled, timeout_s=15, message="the failed chord was not settled")
    assert _body_runs(notes_path, "never") == []


def _publish_parts(url: str, parts: list[ChordPart]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        spec = chord_join_queue(LEGACY_NAMESPACE)
        channel.queue_declare(spec.name, durable=True, arguments=spec.arguments)
        for part in parts:
            body, content_type, encoding = encode_part(part, "json")
            channel.basic_publish(
                "", spec.name, body,
                pika.BasicProperties(content_type=content_type, content_encoding=encoding, delivery_mode=2),
            )  # fmt: skip
    finally:
        connection.close()


def test_the_body_is_sent_once_when_parts_come_twice_and_the_joiner_fails_over(
    session_broker: SessionBroker, notes_path: Path
):
    """Parts held by a joiner that is killed go to the next; copies of a part count once.

    In a vhost of its own, so the two workers here are the only joiners: the first to subscribe
    is the active one (single active consumer), the second takes over when it dies.
    """
    name = unique_queue("chord-failover")
    env = {"CANVAS_NOTES": str(notes_path)}
    with session_broker.own_vhost("clockwork-chord") as url:
        app = App("chord-failover", settings=Settings(broker_url=url, serializer="json"))
        try:
            body_id = f"body-{name}"
            body = _sig(app, name, "collect", label=name, task_id=body_id, reply_to=app.reply_queue)
            body_result = app.AsyncResult(body_id)
            carried = {**body.as_wire(), "chord_size": 3}

            def part(index: int) -> ChordPart:
                return ChordPart(
                    group_id=f"g-{name}", index=index, size=3, task_id=f"t{index}-{name}", state="SUCCESS",
                    result=index * 10, body=carried, reply_to=app.reply_queue, root_id=None,
                )  # fmt: skip

            with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as first:
                first.wait_ready()
                first.first("chord_joiner_subscribed")
                with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as second:
                    second.wait_ready()
                    second.first("chord_joiner_subscribed")
                    # A first task opens the client's result queue, where the body's result comes.
                    assert _sig(app, name, "add", 1, 1).apply_async().get(timeout=30) == 2
                    _publish_parts(url, [part(0), part(0), part(1)])  # a copy of part 0
                    first.first("chord_part_duplicate")  # the first holds all three, unacked
                    first.kill()  # the broker requeues them to the second
                    _publish_parts(url, [part(2), part(1)])  # and a copy of part 1
                    assert body_result.get(timeout=30) == [0, 10, 20]
                    # The line follows the commit, so the body's result can come before it.
                    second.first("chord_part_late")  # the copy of part 1 came after the body
                    assert second.count("chord_body_sent") == 1
                    assert first.count("chord_body_sent") == 0
                    assert _body_runs(notes_path, name) == [[0, 10, 20]]
        finally:
            app.close()


def _join_queue_depth(url: str) -> tuple[int, int]:
    """``(ready messages, consumers)`` of the join queue."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        declared = connection.channel().queue_declare(chord_join_queue(LEGACY_NAMESPACE).name, passive=True)
        return declared.method.message_count, declared.method.consumer_count
    finally:
        connection.close()


def _part(group_id: str, index: int, size: int, body: dict[str, Any], reply_to: str) -> ChordPart:
    return ChordPart(
        group_id=group_id, index=index, size=size, task_id=f"t{index}-{group_id}", state="SUCCESS",
        result=index * 10, body=body, reply_to=reply_to, root_id=None,
    )  # fmt: skip


def test_late_copies_of_parts_after_a_joiner_failover_are_acked_and_send_no_body(
    session_broker: SessionBroker, notes_path: Path
):
    """Chords settled by one joiner; it dies; copies of their parts reach the next joiner.

    Such a copy comes from a header task run again after it sent its part (its worker died before
    acking it). The next joiner knows the chords from the record of settled chords, not from its
    memory: the copy of a part of a chord of three is acked (it was held forever before), and
    the copy of the only part of a chord of one does not send its body a second time.
    """
    name = unique_queue("chord-late")
    env = {"CANVAS_NOTES": str(notes_path)}
    with session_broker.own_vhost("clockwork-chord") as url:
        app = App("chord-late", settings=Settings(broker_url=url, serializer="json"))
        try:

            def parts(label: str, size: int) -> list[ChordPart]:
                body_id, reply_to = f"body-{label}", app.reply_queue
                body = _sig(app, name, "collect", label=label, task_id=body_id, reply_to=reply_to)
                carried = {**body.as_wire(), "chord_size": size}
                return [_part(f"g-{label}", i, size, carried, reply_to) for i in range(size)]

            three, one = parts(f"{name}-3", 3), parts(f"{name}-1", 1)
            with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as first:
                first.wait_ready()
                first.first("chord_joiner_subscribed")
                with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as second:
                    second.wait_ready()
                    second.first("chord_joiner_subscribed")  # before the chords: it learns them later
                    assert _sig(app, name, "add", 1, 1).apply_async().get(timeout=30) == 2
                    _publish_parts(url, [*three, *one])
                    assert app.AsyncResult(f"body-{name}-3").get(timeout=30) == [0, 10, 20]
                    assert app.AsyncResult(f"body-{name}-1").get(timeout=30) == [0]
                    wait_for(lambda: first.count("chord_settled") == 2, timeout_s=10, message="not settled")
                    first.kill()  # the broker makes the second the active joiner
                    _publish_parts(url, [three[1], one[0]])  # as header tasks run again would
                    late = lambda: second.count("chord_part_late") == 2  # noqa: E731
                    wait_for(late, timeout_s=20, message="the copies were not acked as late")
                    assert second.count("chord_body_sent") == 0
                    second.kill()
                    # Gone with its channel, it held nothing: nothing went back to the queue.
                    wait_for(lambda: _join_queue_depth(url)[1] == 0, timeout_s=10, message="still consumed")
                    assert _join_queue_depth(url) == (0, 0)
            assert _body_runs(notes_path, f"{name}-3") == [[0, 10, 20]]
            assert _body_runs(notes_path, f"{name}-1") == [[0]]
        finally:
            app.close()


def test_the_body_runs_once_when_a_worker_dies_mid_chord(session_broker: SessionBroker, notes_path: Path):
    """The first worker runs header tasks and joins; it is killed with a task running and parts held.

    The second, started after the kill, reruns what the first had not acked, becomes the joiner,
    and sends the body once. The kill comes right after the first part, with seconds of header
    work left, so the first cannot have finished the chord (starting the second first let a slow
    machine finish it before the kill).
    """
    name = unique_queue("chord-kill")
    env = {"CANVAS_NOTES": str(notes_path)}
    with session_broker.own_vhost("clockwork-chord") as url:
        app = App("chord-kill", settings=Settings(broker_url=url, serializer="json"))
        try:
            with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as first:
                first.wait_ready()
                first.first("chord_joiner_subscribed")
                header = [_sig(app, name, "slow_add", i, 0, 0.8) for i in range(6)]
                result = chord(header)(_sig(app, name, "collect", label=name))
                first.first("chord_part_sent", timeout_s=30)  # a part is in; 4 s of tasks are left
                first.kill()
                assert first.count("chord_body_sent") == 0
            with WorkerProcess(url, app=APP, queues=[name], concurrency=1, env=env) as second:
                second.wait_ready()
                assert result.get(timeout=60) == [0, 1, 2, 3, 4, 5]
            # The body ran once (the notes). Which process sent it is not asserted: the killed
            # worker's pool children may outlive it long enough to finish the join themselves.
            assert _body_runs(notes_path, name) == [[0, 1, 2, 3, 4, 5]]
        finally:
            app.close()


def test_result_children_lists_what_a_task_sent(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    parent = s("spawn", 2, queue).apply_async()
    assert isinstance(parent, AsyncResult)
    sent = parent.get(timeout=30)
    assert [child.id for child in parent.children] == sent  # from its body
    callback = s("mul", 10)
    first = s("add", 1, 1, link=[callback]).apply_async()
    assert first.get(timeout=30) == 2
    [linked] = first.children
    assert linked.get(timeout=30) == 20  # the callback answered this client: its handle came later
    step = chain(s("add", 2, 2), s("add", 1)).apply_async()
    assert step.get(timeout=30) == 5
    assert isinstance(step, AsyncResult) and isinstance(step.parent, AsyncResult)
    assert [c.id for c in step.parent.children] == [step.id]
    pending = s("slow_add", 0, 0, 1.0).apply_async()
    assert pending.children == []  # not ready yet


@pytest.mark.parametrize(
    ("kind", "expected"), [("sig", 15), ("chain", 18), ("group", [5, 6, 7]), ("nesting", 1)]
)
def test_a_task_replaced_by_a_signature_a_chain_or_a_group_answers_with_its_result(
    client: App, queue: str, kind: str, expected: Any
):
    assert _sig(client, queue, "replace_with", 5, kind).apply_async().get(timeout=30) == expected


def test_a_chain_goes_on_after_a_replaced_step_and_nesting_counts_each_replace(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    # add(1, 1) = 2 -> replace_with(2) by chain: (2 + 1) * 3 = 9 -> mul(9, 2) = 18
    step = client.signature("canvas.replace_with", (), {"kind": "chain"}, queue=queue)
    result = chain(s("add", 1, 1), step, s("mul", 2)).apply_async()
    assert result.get(timeout=30) == 18
    assert s("replace_with", 0, "twice").apply_async().get(timeout=30) == 2


def test_a_replaced_header_task_still_joins_its_chord(client: App, queue: str):
    s = lambda *a, **o: _sig(client, queue, *a, **o)  # noqa: E731
    header = [s("add", 1, 1), s("replace_with", 5, "sig"), s("replace_with", 5, "chain")]
    assert chord(header)(s("collect", label="replaced")).get(timeout=30) == [2, 15, 18]
