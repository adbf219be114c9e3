from __future__ import annotations

import time

from worker.remote.revoked_set import RevokedSet


def test_ids_are_remembered_up_to_maxlen_oldest_first_out():
    revoked = RevokedSet(maxlen=3)
    for task_id in "abcd":
        revoked.add(task_id)
    assert "a" not in revoked and all(t in revoked for t in "bcd")
    assert list(revoked) == ["b", "c", "d"]


def test_ids_expire():
    revoked = RevokedSet(expires_s=10)
    revoked.add("old", at=time.monotonic() - 11)
    revoked.add("new")
    assert "old" not in revoked and "new" in revoked


def test_wire_shape_is_celerys_limited_set():
    fresh = RevokedSet()
    fresh.add("abc")
    wire = fresh.to_wire()
    assert list(wire) == ["abc"] and isinstance(wire["abc"][0], float) and wire["abc"][1] == "abc"


def test_merging_a_peers_set_skips_garbage():
    revoked = RevokedSet()
    new = revoked.merge_wire({"a": [1.5, "a"], "b": 2.0, "c": "nonsense", 5: [1.0, 5], "d": [True]})
    assert new == 2 and "a" in revoked and "b" in revoked and "c" not in revoked
    assert revoked.merge_wire("not a map") == 0


def test_reply_size_is_bounded():
    revoked = RevokedSet()
    revoked.update(f"id-{n}" for n in range(100_000))
    assert len(revoked) == 50_000
    assert len(revoked.to_wire(limit=1000)) == 1000


def test_the_set_survives_a_restart_through_its_state_file(tmp_path):
    path = tmp_path / "w1.revoked"
    revoked = RevokedSet()
    revoked.update(["x", "y"])
    revoked.save(path)
    restarted = RevokedSet()
    assert restarted.load(path) == 2 and "x" in restarted and "y" in restarted


def test_expired_entries_are_not_loaded_and_damaged_files_are_ignored(tmp_path):
    path = tmp_path / "w1.revoked"
    revoked = RevokedSet(expires_s=5)
    revoked.add("stale", at=time.monotonic() - 60)
    revoked.add("fresh")
    revoked._expires_s = 10_000  # save both
    revoked.save(path)
    restarted = RevokedSet(expires_s=5)
    restarted.load(path)
    assert "fresh" in restarted and "stale" not in restarted
    path.write_bytes(b"\xc1garbage")
    assert RevokedSet().load(path) == 0
