from __future__ import annotations

from control.protocol.commands import COMMANDS, CommandKind, CommandRegistry


async def test_dispatch_binds_arguments_and_fills_defaults():
    registry = CommandRegistry()
    seen: dict[str, object] = {}

    async def revoke(task_id, terminate, signal):
        seen.update(task_id=task_id, terminate=terminate, signal=signal)
        return {"ok": "done"}

    registry.register("revoke", revoke)
    assert await registry.dispatch("revoke", {"task_id": ["a"]}) == {"ok": "done"}
    assert seen == {"task_id": ["a"], "terminate": False, "signal": "SIGTERM"}


async def test_unknown_commands_and_bad_arguments_become_error_replies():
    registry = CommandRegistry()

    async def ping():
        return {"ok": "pong"}

    registry.register("ping", ping)
    assert "error" in await registry.dispatch("nope", {})
    assert "error" in await registry.dispatch("ping", {"unexpected": 1})
    assert "error" in await registry.dispatch("revoke", {"task_id": "x"})  # known, but no handler here


async def test_a_wrongly_typed_or_missing_argument_is_refused():
    registry = CommandRegistry()

    async def revoke(task_id, terminate, signal):
        return {"ok": "x"}

    registry.register("revoke", revoke)
    assert "must be" in (await registry.dispatch("revoke", {"task_id": 5}))["error"]
    assert "missing" in (await registry.dispatch("revoke", {}))["error"]


async def test_a_handler_that_raises_gives_a_typed_error():
    registry = CommandRegistry()

    async def ping():
        raise RuntimeError("broken")

    registry.register("ping", ping)
    assert await registry.dispatch("ping", {}) == {"error": "RuntimeError: broken"}


def test_vocabulary_has_celerys_commands():
    inspect = {n for n, c in COMMANDS.items() if c.kind is CommandKind.INSPECT}
    assert {"ping", "clock", "hello", "stats", "active", "reserved", "scheduled", "revoked", "registered",
            "query_task", "active_queues", "conf", "report"} == inspect - {"dedup"}  # fmt: skip
    assert {"revoke", "terminate", "time_limit", "add_consumer", "cancel_consumer", "enable_events",
            "disable_events", "heartbeat", "shutdown"} <= set(COMMANDS)  # fmt: skip


def test_revoke_takes_flowers_flags_and_any_signal_spelling():
    # Flower's Revoke and Terminate buttons send terminate as 0/1 and the signal by name.
    revoke = COMMANDS["revoke"]
    assert revoke.bind({"task_id": "t", "terminate": 1, "signal": "SIGKILL"})["terminate"] is True
    assert revoke.bind({"task_id": "t", "terminate": 0})["terminate"] is False
    assert revoke.bind({"task_id": "t", "terminate": True, "signal": 9})["signal"] == 9
    assert COMMANDS["terminate"].bind({"task_id": "t", "signal": 15})["signal"] == 15
    for bad in ({"terminate": "yes"}, {"signal": 9.5}):
        try:
            revoke.bind({"task_id": "t", **bad})
        except TypeError:
            continue
        raise AssertionError(f"{bad} was accepted")
