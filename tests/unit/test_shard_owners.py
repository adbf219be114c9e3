"""Which live worker keeps each dedup gate shard, and the pacing of handovers (pure)."""

from __future__ import annotations

from collections import Counter

import pytest

from broker_svc.wire.records.dedup import GATE_SHARDS
from worker.rules.shard_owners import HandoverPacing, shard_owners

NAMES = [f"worker{i}@host-{i % 3}" for i in range(12)]


def test_no_members_own_nothing_and_one_member_owns_every_shard():
    assert shard_owners([], GATE_SHARDS) == {}
    assert shard_owners(["alone@h"], GATE_SHARDS) == dict.fromkeys(range(GATE_SHARDS), "alone@h")


@pytest.mark.parametrize("count", range(1, 12))
def test_every_member_keeps_its_share_and_no_more(count: int):
    members = NAMES[:count]
    owners = shard_owners(members, GATE_SHARDS)
    assert sorted(owners) == list(range(GATE_SHARDS))
    load = Counter(owners.values())
    fair = GATE_SHARDS // count
    assert all(fair <= load[m] <= fair + 1 for m in members[:GATE_SHARDS])
    assert set(load) <= set(members)


def test_every_worker_computes_the_same_owners_whatever_the_order_it_sees_them_in():
    members = NAMES[:3]
    assert shard_owners(members, GATE_SHARDS) == shard_owners(list(reversed(members)), GATE_SHARDS)
    assert shard_owners(set(members), GATE_SHARDS) == shard_owners(tuple(members), GATE_SHARDS)


@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_member_that_leaves_moves_its_own_shards_and_few_others(count: int):
    before = shard_owners(NAMES[:count], GATE_SHARDS)
    leaving = NAMES[count - 1]
    after = shard_owners(NAMES[: count - 1], GATE_SHARDS)
    moved = [s for s in range(GATE_SHARDS) if before[s] != after[s] and before[s] != leaving]
    assert leaving not in after.values()
    assert len(moved) <= 2, moved  # rebalancing the shares, not reshuffling


def test_a_gate_that_hands_the_same_shard_over_again_keeps_it_twice_as_long_each_time():
    pacing = HandoverPacing(hold_s=0.5, longest_s=4.0, memory_s=60.0)
    assert pacing.hold(3, now=100.0) == 0.5
    holds = []
    for n in range(6):
        now = 100.0 + n
        holds.append(pacing.hold(3, now))
        pacing.handed_over(3, now)
    assert holds == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert pacing.hold(4, now=106.0) == 0.5  # another shard: its own pace
    assert pacing.hold(3, now=200.0) == 0.5  # forgotten after memory_s
