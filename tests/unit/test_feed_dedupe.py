"""The dedupe window consuming children share (worker.shared.dedupe): one table, whichever child asks."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.waiting import wait_for
from worker.shared.dedupe import WAYS, Claim, SharedDedupe

ROOT = Path(__file__).resolve().parents[2]


def _claim_in_child(path: str, task_id: str, out: multiprocessing.SimpleQueue, hold: bool) -> None:
    table = SharedDedupe(Path(path), ttl_s=60, owner=False)
    claim = table.claim(task_id, 0)
    out.put(claim is not None)
    if hold:  # die with the key claimed, as a child killed in the middle of a task
        os._exit(0)
    if claim is not None:
        table.release(claim, finished=True)
    table.close()


@pytest.fixture
def table():
    shared = SharedDedupe.create(ttl_s=10.0, max_ids=64)
    yield shared
    shared.close()
    assert not shared.path.exists()  # the worker's copy removes its file


def _in_child(table: SharedDedupe, task_id: str, *, hold: bool = False) -> bool:
    context = multiprocessing.get_context("spawn")
    out = context.SimpleQueue()
    child = context.Process(target=_claim_in_child, args=(str(table.path), task_id, out, hold))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    return bool(out.get())


def test_a_key_running_or_finished_in_one_process_is_a_duplicate_in_another(table: SharedDedupe):
    claim = table.claim("a", 0, now=100.0)
    assert claim is not None
    assert _in_child(table, "b")  # another key runs
    table.release(claim, finished=False)  # handed back: a copy may run
    assert _in_child(table, "a")  # ... and did, and finished there
    assert table.claim("a", 0) is None  # finished within the window, in another process
    assert table.claim("a", 1) is not None  # its retry is another key
    assert _in_child(table, "b") is False


def test_a_key_running_in_one_thread_is_a_duplicate_in_another_of_the_same_child(table: SharedDedupe):
    # --threads: every consumer thread of a child claims in the same process.
    claims: list[Claim | None] = []
    first = threading.Thread(target=lambda: claims.append(table.claim("k", 0)))
    first.start()
    first.join()
    (claim,) = claims
    assert claim is not None
    assert table.claim("k", 0) is None  # this thread: another one runs it
    table.release(claim, finished=False)  # released from another thread than the claimer
    assert table.claim("k", 0) is not None


def test_a_key_runs_again_once_its_window_is_over(table: SharedDedupe):
    claim = table.claim("t", 0, now=100.0)
    assert claim is not None
    table.release(claim, finished=True, now=100.0)
    assert table.claim("t", 0, now=109.9) is None
    assert table.claim("t", 0, now=110.1) is not None


def test_a_key_claimed_by_a_child_that_died_runs_again(table: SharedDedupe):
    assert _in_child(table, "lost", hold=True)
    assert table.claim("lost", 0) is not None


def test_a_key_claimed_by_a_zombie_runs_again(table: SharedDedupe):
    # The broker requeues a dead child's task as its socket closes, before anyone reaps it.
    code = (
        "import os, sys; from pathlib import Path; from worker.shared.dedupe import SharedDedupe; "
        "SharedDedupe(Path(sys.argv[1]), ttl_s=60, owner=False).claim('z', 0); os._exit(0)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(table.path)], cwd=ROOT)
    try:
        # Not reaped yet: a zombie, as the table reads a process's state.
        wait_for(lambda: _state(proc.pid) == b"Z", timeout_s=30, message="the child exited")
        assert table.claim("z", 0) is not None
    finally:
        proc.wait(timeout=30)


def _state(pid: int) -> bytes:
    return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]


def test_memory_is_bounded_and_a_full_bucket_forgets_its_oldest_finished_key():
    table = SharedDedupe.create(ttl_s=10.0, max_ids=1)  # one bucket of WAYS entries
    try:
        assert table.buckets == 1 and table.path.stat().st_size == WAYS * 32
        for i in range(WAYS + 1):
            claim = table.claim(f"id-{i}", 0, now=100.0 + i)
            assert claim is not None and claim.offset is not None
            table.release(claim, finished=True, now=100.0 + i)
        assert table.claim("id-0", 0, now=120.0) is not None  # the oldest went to make room
        assert table.claim(f"id-{WAYS}", 0, now=120.0) is None  # the newest is remembered
    finally:
        table.close()


def test_a_bucket_of_live_running_keys_lets_a_new_one_run_unrecorded():
    table = SharedDedupe.create(ttl_s=10.0, max_ids=1)
    other = SharedDedupe(table.path, ttl_s=10.0, owner=False)
    try:
        other._pid = os.getppid()  # running in a live process other than this one
        for i in range(WAYS):
            assert other.claim(f"run-{i}", 0) is not None
        claim = table.claim("one-more", 0)
        assert claim is not None and claim.offset is None
        table.release(claim, finished=True)  # nothing to record
        assert table.claim("run-3", 0) is None
    finally:
        other.close()
        table.close()


def test_nonsense_is_refused(tmp_path: Path):
    with pytest.raises(ValueError):
        SharedDedupe.create(ttl_s=0.0)
    with pytest.raises(ValueError):
        SharedDedupe.create(ttl_s=1.0, max_ids=0)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        SharedDedupe(empty, ttl_s=1.0, owner=False)
    short = tmp_path / "short"
    short.write_bytes(b"\0" * 5)
    with pytest.raises(ValueError, match="no dedupe bucket"):
        SharedDedupe(short, ttl_s=1.0, owner=False)


def test_state_tells_running_finished_and_unknown_apart(table: SharedDedupe):
    assert table.state("a", 0) is None
    claim = table.claim("a", 0, now=100.0)
    assert claim is not None
    assert table.state("a", 0, now=100.0) == "running"  # this process lives
    assert table.state("a", 1, now=100.0) is None  # another attempt is another key
    table.release(claim, finished=True, now=100.0)
    assert table.state("a", 0, now=105.0) == "finished"
    assert table.state("a", 0, now=111.0) is None  # past the window (10 s)
    released = table.claim("b", 0, now=100.0)
    assert released is not None
    table.release(released, finished=False, now=100.0)
    assert table.state("b", 0, now=100.0) is None  # released unfinished: a copy may run


def test_state_ignores_a_dead_childs_claim(table: SharedDedupe):
    assert _in_child(table, "held", hold=True)  # claimed, then the child died holding it
    assert table.state("held", 0) is None
