"""A chord header Celery's client saved (its result tree), read back as Celery's workers join it."""

from __future__ import annotations

import pytest

from broker_svc.errors import MessageError
from broker_svc.redis_results.chords import DependencyFailed, header_ids, header_values

# As Celery stored it for chord([a, chain(b, group(c, d))], body): the chain's result is the group's.
TREE = [
    [["a", None], None],
    [["g-inner", [["b", None], None]], [[["c", None], None], [["d", None], None]]],
]


def ok(value: object) -> dict[str, object]:
    return {"status": "SUCCESS", "result": value}


def test_a_group_in_the_tree_is_one_value_holding_its_list():
    assert header_ids(TREE) == ["a", "c", "d"]
    metas = {"a": ok(1), "c": ok(102), "d": ok(103)}
    assert header_values(TREE, metas) == [1, [102, 103]]


def test_the_first_failed_member_fails_the_chord_and_a_missing_one_is_a_join_error():
    failure = {"status": "FAILURE", "result": {"exc_type": "ValueError", "exc_message": ["boom"]}}
    with pytest.raises(DependencyFailed) as failed:
        header_values(TREE, {"a": ok(1), "c": failure, "d": ok(3)})
    assert failed.value.task_id == "c" and failed.value.result["exc_type"] == "ValueError"
    with pytest.raises(MessageError, match="d has no result"):
        header_values(TREE, {"a": ok(1), "c": ok(2)})
    with pytest.raises(MessageError, match="not a result tuple"):
        header_ids([["just-an-id"]])
