"""Revokes by stamps: which stamped tasks they match (Celery's rule), and their log entries."""

from __future__ import annotations

import asyncio
import json

import pytest

from broker_svc.errors import MessageError
from control.protocol.commands import CommandRegistry
from control.protocol.revoke_log import RevokeEntry
from worker.rules.revoked_stamps import RevokedStamps


@pytest.mark.parametrize(
    ("task_stamps", "hit"),
    [
        ({"batch": "b1"}, ("batch", "b1")),
        ({"batch": ["x", "b2"]}, ("batch", "b2")),  # a list matches by any of its values
        ({"batch": "b3"}, None),
        ({"other": "b1"}, None),  # the same value under another name
        ({"batch": None}, None),
        ({"batch": {"b1": 1}}, None),  # a map never equals a revoked scalar
        ({"n": 7}, ("n", 7)),
        ({}, None),
    ],
)
def test_a_task_matches_when_one_of_its_stamps_has_a_revoked_value(task_stamps, hit):
    revoked = RevokedStamps()
    revoked.add({"batch": ["b1", "b2"], "n": [7]})
    assert revoked.matching(task_stamps) == hit


def test_only_new_values_are_reported_and_the_oldest_go_past_the_bound():
    revoked = RevokedStamps(max_values=3)
    assert revoked.add({"k": ["a", "b"]}) == {"k": ["a", "b"]}
    assert revoked.add({"k": ["b", "c"]}) == {"k": ["c"]}
    assert revoked.add({"j": ["d"]}) == {"j": ["d"]}
    assert revoked.to_wire() == {"k": ["b", "c"], "j": ["d"]}
    assert revoked.matching({"k": "a"}) is None


def test_a_stamped_log_entry_round_trips_and_an_id_entry_has_no_stamps():
    entry = RevokeEntry.stamped(["batch=b1"], terminate=True, signal="KILL", hostname="c")
    decoded = RevokeEntry.decode(entry.encode())
    assert decoded.stamps == {"batch": ["b1"]} and decoded.task_ids == ()
    assert decoded.terminate and decoded.signal == "KILL"
    assert RevokeEntry.decode(RevokeEntry.new(["id"]).encode()).stamps is None
    with pytest.raises(ValueError):
        RevokeEntry.stamped({})
    bad = json.dumps({"task_ids": [], "stamps": {"k": {"nested": 1}}}).encode()
    with pytest.raises(MessageError):
        RevokeEntry.decode(bad)


def test_the_command_refuses_headers_that_are_not_a_map_or_a_list():
    registry = CommandRegistry()

    async def handler(**arguments):
        return arguments

    registry.register("revoke_by_stamped_headers", handler)
    reply = asyncio.run(registry.dispatch("revoke_by_stamped_headers", {"headers": "k=v"}))
    assert "error" in reply
    bound = asyncio.run(
        registry.dispatch("revoke_by_stamped_headers", {"headers": {"k": "v"}, "terminate": 1})
    )
    assert bound == {"headers": {"k": "v"}, "terminate": True, "signal": "SIGTERM"}
