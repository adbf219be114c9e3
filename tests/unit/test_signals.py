"""Signals as Celery's: connect (also as a decorator), sender filters, weak references, failures logged."""

from __future__ import annotations

import gc
from typing import Any

from structlog.testing import capture_logs

from broker_svc import App
from broker_svc.signals import Signal


def test_receivers_get_the_signal_sender_and_named_arguments_in_order():
    signal = Signal("probe")
    calls: list[tuple[str, Any]] = []

    @signal.connect
    def first(signal: Signal, sender: Any, **named: Any) -> str:
        calls.append(("first", named))
        return "one"

    @signal.connect(weak=False)
    def second(**named: Any) -> str:
        calls.append(("second", named["value"]))
        return "two"

    responses = signal.send(sender="me", value=3)
    assert [r for _, r in responses] == ["one", "two"]
    assert calls == [("first", {"value": 3}), ("second", 3)]


def test_a_sender_filter_matches_the_object_or_a_task_of_the_same_name():
    app = App("signals", broker="amqp://guest:guest@127.0.0.1:5672//")

    @app.task(name="signals.add")
    def add(x: int, y: int) -> int:
        return x + y

    signal = Signal("probe")
    seen: list[Any] = []
    signal.connect(lambda sender, **_: seen.append(("task", sender.name)), sender=add, weak=False)
    signal.connect(lambda sender, **_: seen.append(("name", sender.name)), sender="signals.add", weak=False)
    signal.send(sender=app.tasks["signals.add"])
    signal.send(sender=object())  # neither listens to this one
    assert seen == [("task", "signals.add"), ("name", "signals.add")]


def test_a_failing_receiver_is_logged_and_the_others_still_run():
    signal = Signal("probe")
    ran: list[str] = []

    def broken(**_: Any) -> None:
        raise RuntimeError("receiver bug")

    signal.connect(broken, weak=False)
    signal.connect(lambda **_: ran.append("after"), weak=False)
    with capture_logs() as logs:
        responses = signal.send(sender=None)
    assert ran == ["after"]
    assert isinstance(responses[0][1], RuntimeError)
    assert [e["event"] for e in logs] == ["signal_receiver_failed"]


def test_weak_receivers_go_with_their_owner_and_dispatch_uid_registers_once():
    signal = Signal("probe")

    class Owner:
        def on(self, **_: Any) -> str:
            return "alive"

    owner = Owner()
    signal.connect(owner.on)
    assert signal.send(sender=None) == [(owner.on, "alive")]
    del owner
    gc.collect()
    assert signal.send(sender=None) == []

    def receiver(**_: Any) -> None:
        return None

    signal.connect(receiver, dispatch_uid="once")
    signal.connect(receiver, dispatch_uid="once")
    assert len(signal.receivers) == 1
    assert signal.disconnect(dispatch_uid="once")
    assert signal.receivers == []
