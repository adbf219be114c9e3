"""Chords on the wire: how a chord signature becomes header tasks carrying the body, and the parts."""

from __future__ import annotations

import json
from typing import Any

import pytest

from broker_svc import App, chain, chord, group
from broker_svc.canvas.follow_ups import chord_header_problem, follow_ups, unhonoured
from broker_svc.canvas.signature import maybe_signature
from broker_svc.wire.records.chord_part import ChordPart, decode_part, encode_part
from broker_svc.wire.task.task_message import TaskMessage

PARENT = TaskMessage(
    id="p1", task="t.parent", root_id="r1", reply_to="client-q", content_type="application/json"
)


def sig(task: str, *args: Any, kind: str | None = None, **options: Any) -> dict[str, Any]:
    return {"task": task, "args": list(args), "kwargs": {}, "options": options, "subtask_type": kind,
            "immutable": False}  # fmt: skip


def celery_chord(members: list[dict[str, Any]], body: dict[str, Any], **options: Any) -> dict[str, Any]:
    # The map Celery's client puts in a chain for ``a | group(...) | body``.
    header = {**sig("celery.group", kind="group", task_id="g1"), "kwargs": {"tasks": members}}
    return {
        **sig("celery.chord", kind="chord", **options),
        "kwargs": {"header": header, "body": body, "kwargs": {}},
    }


def test_a_chord_step_sends_its_header_each_carrying_the_body_with_the_chord_size():
    step = celery_chord([sig("t.a", 1), sig("t.b", 2)], sig("t.sum", task_id="body-1"))
    sent = follow_ups(step, parent=PARENT, partial=(7,))
    assert [(f.message.task, f.message.args) for f in sent] == [("t.a", [7, 1]), ("t.b", [7, 2])]
    assert [(f.message.group, f.message.group_index) for f in sent] == [("g1", 0), ("g1", 1)]
    carried = sent[0].message.embed["chord"]
    assert carried["chord_size"] == 2 and carried["task"] == "t.sum"
    assert carried["options"]["task_id"] == "body-1"
    assert carried["options"]["reply_to"] == "client-q"  # the body's result reaches the caller
    assert unhonoured(sent[0].message.embed) is None
    assert chord_header_problem(sent[0].message.embed, "g1", 1) is None


def test_the_steps_after_a_chord_ride_on_its_body():
    step = celery_chord([sig("t.a")], sig("t.sum"))
    [header] = follow_ups(step, parent=PARENT, partial=(), chain_rest=[sig("t.last")])
    assert [s["task"] for s in header.message.embed["chord"]["options"]["chain"]] == ["t.last"]
    # When the joiner sends that body, the rest of the chain is its chain.
    [body] = follow_ups(header.message.embed["chord"], parent=PARENT, partial=([1],))
    assert body.message.args == [[1]]
    assert [s["task"] for s in body.message.embed["chain"]] == ["t.last"]


def test_a_chord_with_an_empty_header_sends_its_body_with_an_empty_list():
    [body] = follow_ups(celery_chord([], sig("t.sum")), parent=PARENT, partial=(1,))
    assert (body.message.task, body.message.args) == ("t.sum", [[]])


@pytest.mark.parametrize(
    ("group_id", "index", "why"),
    [(None, 0, "chord's id"), ("g", None, "group_index"), ("g", 2, "group_index < 2")],
)
def test_a_header_task_without_its_place_cannot_join(group_id: str | None, index: int | None, why: str):
    embed = {"chord": {**sig("t.sum"), "chord_size": 2}}
    problem = chord_header_problem(embed, group_id, index)
    assert problem is not None and why in problem


def chain_of(*steps: dict[str, Any]) -> dict[str, Any]:
    return {**sig("celery.chain", kind="chain"), "kwargs": {"tasks": list(steps)}}


def group_of(*members: dict[str, Any]) -> dict[str, Any]:
    return {**sig("celery.group", kind="group"), "kwargs": {"tasks": list(members)}}


def test_a_nested_header_leaves_one_part_per_member_in_celerys_order():
    inner = celery_chord([sig("t.f"), sig("t.g")], sig("t.h", task_id="inner-body"))
    inner["kwargs"]["header"]["options"]["task_id"] = "g2"
    header = [sig("t.a"), chain_of(sig("t.b"), sig("t.c")), group_of(sig("t.d"), sig("t.e")), inner]
    step = celery_chord(header, sig("t.sum", task_id="body-1"))
    assert unhonoured({"chain": [step]}) is None
    sent = follow_ups(step, parent=PARENT, partial=())
    # a; the chain's first step; the group unrolled as Celery unrolls it (reversed); the inner header.
    assert [f.message.task for f in sent] == ["t.a", "t.b", "t.e", "t.d", "t.f", "t.g"]
    by_task = {f.message.task: f.message for f in sent}
    assert [(by_task[t].group, by_task[t].group_index) for t in ("t.a", "t.e", "t.d")] == [
        ("g1", 0), ("g1", 2), ("g1", 3),
    ]  # fmt: skip
    assert by_task["t.a"].embed["chord"]["chord_size"] == 4 + 1
    # The chain's last step leaves part 1; its first step is no member.
    assert by_task["t.b"].group is None and by_task["t.b"].embed["chord"] is None
    [last] = by_task["t.b"].embed["chain"]
    assert (last["options"]["group_id"], last["options"]["group_index"]) == ("g1", 1)
    assert last["options"]["chord"]["options"]["task_id"] == "body-1"
    # The inner chord joins on its own id; its body leaves part 4 of the outer chord.
    inner_carried = by_task["t.f"].embed["chord"]
    assert by_task["t.f"].group == "g2" and inner_carried["chord_size"] == 2
    assert (inner_carried["options"]["group_id"], inner_carried["options"]["group_index"]) == ("g1", 4)
    [inner_body] = follow_ups(inner_carried, parent=PARENT, partial=([1, 2],))
    assert (inner_body.message.id, inner_body.message.group, inner_body.message.group_index) == (
        "inner-body", "g1", 4,
    )  # fmt: skip
    assert inner_body.message.embed["chord"]["options"]["task_id"] == "body-1"


def test_a_group_ending_a_chain_in_a_header_is_one_part_holding_its_list():
    # As Celery's client sends it: the group carries the chord; Celery's workers give its list.
    outer_body = {**sig("t.collect", task_id="body-1", queue="q1"), "chord_size": 2}
    group_step = {**group_of(sig("t.x"), sig("t.y")), "options": {"group_id": "g1", "group_index": 1,
                                                                  "chord": outer_body}}  # fmt: skip
    sent = follow_ups(group_step, parent=PARENT, partial=(5,))
    assert [(f.message.task, f.message.args) for f in sent] == [("t.x", [5]), ("t.y", [5])]
    carried = sent[0].message.embed["chord"]
    assert sent[0].message.group not in (None, "g1") and carried["chord_size"] == 2
    assert carried["task"] == "celery.accumulate" and carried["kwargs"] == {"index": 0}
    [accumulate] = follow_ups(carried, parent=PARENT, partial=([6, 7],))
    assert (accumulate.message.group, accumulate.message.group_index) == ("g1", 1)
    assert accumulate.queue == "q1"  # no member names a queue: where the outer body runs
    assert accumulate.message.embed["chord"]["options"]["task_id"] == "body-1"


def test_a_group_followed_by_a_step_inside_a_header_chain_becomes_a_chord():
    step = celery_chord([chain_of(sig("t.a"), group_of(sig("t.x"), sig("t.y")), sig("t.sum"))], sig("t.all"))
    [first] = follow_ups(step, parent=PARENT, partial=())
    [upgraded] = first.message.embed["chain"]
    assert upgraded["subtask_type"] == "chord"
    assert upgraded["kwargs"]["body"]["options"]["group_index"] == 0  # t.sum leaves the part


def test_our_client_builds_the_same_shapes():
    app = App("chords", broker="amqp://guest:guest@127.0.0.1:5672//")
    add = app.signature("t.add", (1,))
    piped = group(add, add) | app.signature("t.sum")
    assert isinstance(piped, chord) and len(piped.tasks) == 2
    upgraded = chain(add, group(add, add), app.signature("t.sum"), add)
    wire = upgraded.tasks  # the upgrade happens when it is sent; the map form goes through maybe_signature
    assert [s.task for s in wire] == ["t.add", "celery.group", "t.sum", "t.add"]
    again = maybe_signature(json.loads(json.dumps(chord([add], app.signature("t.sum")).as_wire())))
    assert isinstance(again, chord) and again.body is not None and again.body.task == "t.sum"
    with pytest.raises(ValueError, match="needs a body"):
        chord([add]).apply_async()


def test_a_part_survives_both_codecs_and_bad_parts_are_named():
    part = ChordPart(
        group_id="g", index=1, size=2, task_id="t", state="SUCCESS", result={"x": [1, 2]},
        body=sig("t.sum"), reply_to="q", root_id=None,
    )  # fmt: skip
    for codec_name in ("json", "msgpack"):
        body, content_type, _ = encode_part(part, codec_name)
        assert decode_part(body, content_type, max_bytes=1 << 20) == part
    bad = json.dumps({"group_id": "g", "index": 2, "size": 2, "task_id": "t", "state": "SUCCESS", "body": {}})
    with pytest.raises(ValueError, match="index < size"):
        decode_part(bad.encode(), "application/json", max_bytes=1 << 20)
    with pytest.raises(ValueError):
        decode_part(b"\x00not json", "application/json", max_bytes=1 << 20)
    with pytest.raises(ValueError):
        decode_part(b"{}", "application/x-python-serialize", max_bytes=1 << 20)


def test_a_chord_runs_eagerly_with_apply():
    app = App("eager-chords", broker="amqp://guest:guest@127.0.0.1:5672//")

    @app.task(name="e.add")
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="e.xsum")
    def xsum(values: list[int]) -> int:
        return sum(values)

    assert chord([add.s(1, 1), add.s(2, 2)], xsum.s()).apply().get() == 6
    assert (group(add.s(i, i) for i in range(3)) | xsum.s()).apply().get() == 6
