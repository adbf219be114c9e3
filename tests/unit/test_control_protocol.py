from __future__ import annotations

import pytest

from broker_svc.errors import MessageError
from control.protocol.request import ControlRequest, ReplyAddress, flatten_replies


def test_a_call_round_trips_in_celerys_body_shape():
    request = ControlRequest(
        method="ping",
        ticket="t-1",
        reply_to=ReplyAddress("reply.celery.pidbox", "oid-1"),
        destination=("a@h",),
    )
    body = request.to_wire()
    assert body == {
        "method": "ping", "arguments": {}, "destination": ["a@h"], "pattern": None, "matcher": None,
        "ticket": "t-1", "reply_to": {"exchange": "reply.celery.pidbox", "routing_key": "oid-1"},
    }  # fmt: skip
    assert ControlRequest.from_wire(body) == request and request.wants_reply


def test_a_cast_has_no_ticket_or_reply_to():
    body = ControlRequest(method="heartbeat").to_wire()
    assert "ticket" not in body and "reply_to" not in body
    assert not ControlRequest.from_wire(body).wants_reply


@pytest.mark.parametrize(
    ("fields", "node", "expected"),
    [
        ({}, "w1@h", True),
        ({"destination": ("w1@h",)}, "w1@h", True),
        ({"destination": ("w2@h",)}, "w1@h", False),
        ({"pattern": "w*@h", "matcher": "glob"}, "w1@h", True),
        ({"pattern": "x*", "matcher": "glob"}, "w1@h", False),
        ({"pattern": r"w\d@h", "matcher": "pcre"}, "w1@h", True),
        ({"pattern": "(", "matcher": "pcre"}, "w1@h", False),
    ],
)
def test_destination_and_patterns_select_nodes(fields, node, expected):
    assert ControlRequest(method="ping", **fields).is_for(node) is expected


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"arguments": {}},
        {"method": ""},
        {"method": "ping", "arguments": [1]},
        {"method": "ping", "destination": [1]},
        {"method": "ping", "pattern": "x" * 1000},
        {"method": "ping", "matcher": "lua"},
        {"method": "ping", "reply_to": {"exchange": 1}},
    ],
)
def test_malformed_requests_are_refused(body):
    with pytest.raises(MessageError):
        ControlRequest.from_wire(body)


def test_flatten_replies_keeps_one_value_per_node():
    replies = [{"a@h": {"ok": "pong"}}, {"b@h": None}, "junk", {"x": 1, "y": 2}, {"a@h": {"ok": "again"}}]
    assert flatten_replies(replies) == {"a@h": {"ok": "again"}, "b@h": None}
