"""The spool's store, slots and segments on real files (no broker): triggers, bounds, order, replay."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import SpoolFull
from broker_svc.settings import Settings
from broker_svc.spool.segment import MAGIC, recover, segment_paths
from broker_svc.spool.slots import claim_slot, try_slot
from broker_svc.spool.store import SpoolStore
from broker_svc.topology import task_queue
from broker_svc.wire.task.task_message import RESENT_HEADER, WireMessage
from tests.support.waiting import wait_for
from tests.support.workers import ROOT


def _pending(n: int, *, size: int = 10) -> PendingPublish:
    message = WireMessage(
        body=b"x" * size, content_type="application/x-msgpack", content_encoding="binary",
        headers={"id": f"task-{n}", "task": "t.x"}, correlation_id=f"task-{n}",
    )  # fmt: skip
    return PendingPublish(message, exchange="", routing_key="jobs", declare=(task_queue("jobs"),))


def _store(directory: Path, **options: object) -> SpoolStore:
    settings = Settings(spool_dir=str(directory), **options)  # type: ignore[arg-type]
    store = SpoolStore(directory, settings)
    store.open()
    store.recover()
    return store


def _ids(entries: list) -> list[str]:
    return [e.template.message.headers["id"] for e in entries]


def test_the_count_trigger_writes_once_the_count_is_reached(tmp_path: Path):
    store = _store(tmp_path, spool_flush_count=4, spool_fsync=False)
    store.append([_pending(n) for n in range(3)])
    assert store.figures().written == 0 and segment_paths(tmp_path) == []
    store.append([_pending(3)])
    assert store.figures().written == 4 and store.figures().buffered == 0
    assert len(segment_paths(tmp_path)) == 1


def test_the_drain_takes_in_order_and_a_task_settled_before_its_write_is_never_written(tmp_path: Path):
    store = _store(tmp_path, spool_flush_count=100, spool_fsync=False)
    store.append([_pending(n) for n in range(5)])
    taken = store.take(3)
    assert _ids(taken) == ["task-0", "task-1", "task-2"]
    for entry in taken:
        entry.settled = True  # confirmed before the time trigger came
    store.write()
    assert store.figures().written == 2
    assert _ids(store.take(10)) == ["task-3", "task-4"]


def test_past_the_memory_bound_tasks_are_read_back_from_disk_in_order_with_their_handles(tmp_path: Path):
    store = _store(tmp_path, spool_flush_count=2, spool_memory_records=4, spool_fsync=False)
    handles = [_pending(n) for n in range(50)]
    for pending in handles:
        store.append([pending])
    assert len(store._unsent) <= 5  # the rest is only on disk
    taken = store.take(20) + store.take(100)  # from disk, then memory once caught up
    assert _ids(taken) == [f"task-{n}" for n in range(50)]
    assert [e.handle for e in taken] == handles  # results still settle
    assert all(RESENT_HEADER not in e.template.message.headers and not e.resend for e in taken)


def test_a_dropped_result_is_not_kept_alive_by_the_spool(tmp_path: Path):
    store = _store(tmp_path, spool_flush_count=1, spool_memory_records=1, spool_fsync=False)
    for n in range(10):
        store.append([_pending(n)])  # no reference kept
    gc.collect()
    taken = store.take(100)
    assert len(taken) == 10 and sum(e.handle is None for e in taken) >= 8
    assert len(store._handles) == 0


def test_a_successor_replays_what_was_written_marked_resent_and_skips_what_was_settled(tmp_path: Path):
    first = _store(tmp_path, spool_flush_count=1, spool_fsync=False)
    for n in range(10):
        first.append([_pending(n)])
    taken = first.take(4)
    first.set_low(taken[-1].seq + 1)  # the first four confirmed
    first.collect()  # saves low; the process then dies without closing
    second = SpoolStore(tmp_path, Settings(spool_dir=str(tmp_path)))
    second.open()
    assert second.recover() == 6
    replay = second.take(100)
    assert _ids(replay) == [f"task-{n}" for n in range(4, 10)]
    assert all(e.resend and e.handle is None for e in replay)
    second.append([_pending(99)])
    new = second.take(10)
    assert _ids(new) == ["task-99"] and not new[0].resend and new[0].seq == 10


def test_a_record_cut_by_a_crash_is_truncated_and_the_rest_replayed(tmp_path: Path):
    first = _store(tmp_path, spool_flush_count=1, spool_fsync=False)
    for n in range(3):
        first.append([_pending(n)])
    [path] = segment_paths(tmp_path)
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(b"\x40\x00\x00\x00half a record")
    second = SpoolStore(tmp_path, Settings(spool_dir=str(tmp_path)))
    second.open()
    assert path.stat().st_size == whole  # the last segment is cut at once, before any new write
    assert second.recover() == 3
    assert path.stat().st_size == whole
    assert _ids(second.take(10)) == ["task-0", "task-1", "task-2"]


def test_files_a_crash_can_leave_never_stop_a_start(tmp_path: Path):
    (tmp_path / "00000000000000000007.spool").write_bytes(MAGIC[:3])  # died while creating it
    (tmp_path / "00000000000000000009.spool").write_bytes(b"not a spool file at all")
    assert recover(tmp_path / "00000000000000000007.spool") is None
    assert recover(tmp_path / "00000000000000000009.spool") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000000000000000009.corrupt"]
    store = SpoolStore(tmp_path, Settings(spool_dir=str(tmp_path)))
    store.open()
    assert store.recover() == 0


def test_over_spool_max_bytes_a_call_raises_and_none_of_its_tasks_is_taken(tmp_path: Path):
    store = _store(tmp_path, spool_max_bytes=2000, spool_fsync=False)
    store.append([_pending(n, size=100) for n in range(5)])
    with pytest.raises(SpoolFull, match="spool_max_bytes=2000"):
        store.append([_pending(n, size=100) for n in range(5, 20)])
    figures = store.figures()
    assert figures.accepted == 5 and figures.refused == 15 and figures.unsent == 5
    assert _ids(store.take(100)) == [f"task-{n}" for n in range(5)]


def test_a_live_process_holds_its_slot_and_a_killed_one_frees_it(tmp_path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, threading
            from pathlib import Path
            from broker_svc.spool.slots import claim_slot
            slot = claim_slot(Path({str(tmp_path)!r}))
            print(slot.path.name, flush=True)
            threading.Event().wait(120)
        """)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "slot-0"
        mine = claim_slot(tmp_path)
        assert mine.path.name == "slot-1"  # never the live process's slot
        assert try_slot(tmp_path / "slot-0") is None
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        freed = wait_for(lambda: try_slot(tmp_path / "slot-0"), timeout_s=10, message="slot-0 stayed held")
        assert freed is not None and freed.path.name == "slot-0"
        freed.release()
        mine.release()
    finally:
        holder.kill()
        holder.wait(30)
        if holder.stdout is not None:
            holder.stdout.close()


@pytest.mark.parametrize("ordered", [True, False])
def test_a_replayed_task_declares_its_queue_ordered_as_the_producer_is_configured(
    tmp_path: Path, ordered: bool
):
    # The record keeps the queue's type; whether it is ordered comes from the replaying producer.
    first = _store(tmp_path, spool_flush_count=1, spool_fsync=False)
    first.append([_pending(1)])
    first.collect()
    settings = Settings(
        spool_dir=str(tmp_path), ordered_queues=("jobs",) if ordered else (), queue_max_priority=10
    )
    second = SpoolStore(tmp_path, settings)
    second.open()
    assert second.recover() == 1
    [replayed] = second.take(10)
    [declared] = replayed.template.declare
    assert declared.name == "jobs"
    assert declared.arguments.get("x-single-active-consumer", False) is ordered
    assert declared.arguments["x-max-priority"] == 10
