"""What a worker sends after a task, from the message's embed (Celery's semantics, WIRE.md §3.3)."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc import App
from broker_svc.canvas.follow_ups import follow_ups, runs_in_process, unhonoured
from broker_svc.wire.task.task_message import TaskMessage


def sig(
    task: str, *args: Any, immutable: bool = False, kind: str | None = None, **options: Any
) -> dict[str, Any]:
    return {"task": task, "args": list(args), "kwargs": {}, "options": options, "subtask_type": kind,
            "immutable": immutable}  # fmt: skip


PARENT = TaskMessage(
    id="p1", task="t.parent", root_id="r1", reply_to="client-q", content_type="application/json"
)


def test_a_step_gets_the_value_first_and_inherits_root_reply_to_and_serializer():
    [step] = follow_ups(sig("t.add", 3, queue="q1", task_id="s2"), parent=PARENT, partial=(7,))
    message = step.message
    assert (message.id, message.task, message.args) == ("s2", "t.add", [7, 3])
    assert (message.parent_id, message.root_id, message.reply_to) == ("p1", "r1", "client-q")
    assert message.content_type == "application/json" and step.queue == "q1"


def test_an_immutable_step_ignores_the_value():
    [step] = follow_ups(sig("t.add", 1, 2, immutable=True), parent=PARENT, partial=(7,))
    assert step.message.args == [1, 2]
    assert step.queue is None  # routed by the worker's app


def test_the_rest_of_a_chain_travels_with_the_next_step_last_first():
    rest = [sig("t.c"), sig("t.b")]
    [step] = follow_ups(sig("t.a"), parent=PARENT, partial=(1,), chain_rest=rest)
    assert step.message.embed["chain"] == rest


def test_a_group_callback_sends_each_member_with_the_group_id_and_index():
    group = sig("celery.group", kind="group", group_id="g1")
    group["kwargs"] = {"tasks": [sig("t.a"), sig("t.b")]}
    steps = follow_ups(group, parent=PARENT, partial=(5,))
    assert [(s.message.task, s.message.args, s.message.group, s.message.group_index) for s in steps] == [
        ("t.a", [5], "g1", 0), ("t.b", [5], "g1", 1),
    ]  # fmt: skip


def test_a_chain_callback_runs_its_first_step_carrying_its_rest():
    chain = sig("celery.chain", kind="chain")
    chain["kwargs"] = {"tasks": [sig("t.a"), sig("t.b"), sig("t.c")]}
    [step] = follow_ups(chain, parent=PARENT, partial=(5,))
    assert step.message.task == "t.a"
    assert [s["task"] for s in step.message.embed["chain"]] == ["t.c", "t.b"]


@pytest.mark.parametrize(
    ("embed", "why"),
    [
        ({"chord": sig("t.body")}, "chord_size"),
        ({"chord": {**sig("t.body", kind="group"), "chord_size": 2}}, "kwargs.tasks"),
        ({"callbacks": [sig("t.x", kind="weave")]}, "subtask_type"),
        ({"callbacks": [sig("t.x", kind="chord")]}, "kwargs.body"),
        ({"callbacks": "not a list"}, "list"),
        ({"callbacks": [sig("t.x", exchange="media", routing_key="video.hd")]}, "exchange"),
        ({"errbacks": [{"args": []}]}, "task name"),
        ({"chain": [sig("t.last"), {**sig("g", kind="group"), "kwargs": {"tasks": [sig("t.a")]}}]}, "chord"),
    ],
)
def test_what_cannot_be_honoured_is_named(embed: dict[str, Any], why: str):
    reason = unhonoured({"callbacks": None, "errbacks": None, "chain": None, "chord": None, **embed})
    assert reason is not None and why in reason


def test_plain_canvases_are_honoured():
    embed = {"callbacks": [sig("t.a")], "errbacks": [sig("t.b")], "chain": [sig("t.c")], "chord": None}
    assert unhonoured(embed) is None


def test_errbacks_that_take_request_exc_traceback_run_in_process_as_in_celery():
    app = App("errbacks", broker="amqp://guest:guest@127.0.0.1:5672//")

    @app.task(name="eb.old")
    def old(task_id: str) -> None: ...

    @app.task(name="eb.new")
    def new(request: Any, exc: BaseException, traceback: str) -> None: ...

    @app.task(name="eb.varargs")
    def varargs(*args: Any) -> None: ...

    @app.task(name="eb.bound", bind=True)
    def bound(self: Any, request: Any, exc: BaseException, traceback: str) -> None: ...

    assert not runs_in_process(app, sig("eb.old"))
    assert runs_in_process(app, sig("eb.new"))
    assert runs_in_process(app, sig("eb.varargs"))
    assert not runs_in_process(app, sig("eb.bound"))  # Celery sends bound errbacks as tasks
    assert not runs_in_process(app, sig("eb.elsewhere"))  # not registered here: sent as a task
