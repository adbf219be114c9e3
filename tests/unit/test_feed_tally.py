"""A child's counts (worker.consume.tally) and its ledger (worker.consume.ledger), without a broker."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from broker_svc import Settings
from broker_svc.errors import DecodeError
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.spec import FeedSpec
from worker.consume.ledger import FeedLedger
from worker.consume.tally import Tally
from worker.ipc import Job
from worker.pool.feeding import Feeding
from worker.rules.disposition import ACK, HAND_BACK, Disposition, Fate
from worker.shared.dedupe import SharedDedupe


def test_a_tally_goes_through_its_frame_unchanged():
    tally = Tally()
    tally.count("succeeded", "t", "q", n=3)
    tally.count("failed", "t", "q", "ValueError")
    tally.count("dead_lettered", "q", "NotRegistered")
    tally.count("total", "t", n=4)
    tally.ran("t", "q", 0.25)
    tally.confirmed("result", 0.002)
    tally.count("unknown", "nope")
    back = Tally.from_frame(ipc.decode_frame(ipc.encode_frame(tally.to_frame())[ipc.HEADER.size :]))
    assert back.counts == tally.counts and back.runtimes == {("t", "q"): [0.25]}
    assert back.confirms == {"result": [0.002]}
    assert back.of("total") == {("t",): 4}
    assert not Tally() and back


@pytest.mark.parametrize(
    "frame",
    [
        {"op": "tally", "counts": [["nonsense", "t", "q", 1]]},
        {"op": "tally", "counts": [["succeeded", "t", 1]]},  # a label short
        {"op": "tally", "counts": [["total", "t", -1]]},
        {"op": "tally", "counts": [["total", "t", True]]},
        {"op": "tally", "counts": "total"},
        {"op": "tally", "runtimes": [["t", "q", ["slow"]]]},
        {"op": "tally", "confirms": [["result", "fast"]]},
        {"op": "tally", "confirms": [["result"]]},
    ],
)
def test_a_malformed_tally_frame_is_refused(frame: dict[str, Any]):
    with pytest.raises(DecodeError):
        Tally.from_frame(frame)


class _Worker:
    """The worker's end of a child's socket: the frames the child sent."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.channel = ChildChannel(self.theirs)

    def tallies(self) -> Tally:
        total = Tally()
        self.ours.setblocking(False)
        data = b""
        try:
            while chunk := self.ours.recv(65536):
                data += chunk
        except BlockingIOError:
            pass
        while data:
            length = ipc.frame_length(data[: ipc.HEADER.size])
            frame = ipc.decode_frame(data[ipc.HEADER.size : ipc.HEADER.size + length])
            data = data[ipc.HEADER.size + length :]
            assert frame["op"] == "tally"
            total.add(Tally.from_frame(frame))
        return total


@pytest.fixture
def worker() -> Iterator[_Worker]:
    end = _Worker()
    yield end
    end.ours.close()
    end.theirs.close()


def _request(task_id: str, retries: int = 0) -> Any:
    return SimpleNamespace(id=task_id, retries=retries, task="t")


def _delivery(headers: dict[str, Any] | None = None) -> Any:
    return SimpleNamespace(queue="q", headers=headers or {})


def _job(task_id: str) -> Job:
    return Job(task_id=task_id, task_name="t", args=[], kwargs={}, request={})


def _handle(
    ledger: FeedLedger,
    task_id: str,
    done: dict[str, Any],
    *,
    finished: bool = True,
    headers: dict[str, Any] | None = None,
) -> bool:
    """One delivery through the ledger as the child's loop and handler take it; whether it ran."""
    with ledger.settling(_delivery(headers)):
        if ledger.duplicate(_request(task_id), redelivered=False):
            return False
        ledger.timed(lambda job: done)(_job(task_id))
        ledger.decided((Disposition(Fate.ACK, ran=True, finished=finished), None))
    return True


def test_the_ledger_claims_remembers_and_reports_each_delivery(worker: _Worker):
    table = SharedDedupe.create(ttl_s=60.0, max_ids=64)
    ledger = FeedLedger(dedupe=SharedDedupe(table.path, ttl_s=60.0, owner=False), report_every_s=3600)
    try:
        ledger.report_to(worker.channel)
        assert _handle(ledger, "a", {"status": "SUCCESS"})
        assert not _handle(ledger, "a", {"status": "SUCCESS"})  # finished: the copy is skipped
        failed = {"status": "FAILURE", "error": {"exc_type": "KeyError"}}
        assert _handle(ledger, "b", failed, finished=False)  # e.g. handed back to run again
        assert _handle(ledger, "b", failed)  # so its copy runs
        with ledger.settling(_delivery()):
            assert not ledger.duplicate(_request("c"), redelivered=True)
            ledger.decided((Disposition.dead_letter("NotRegistered", "no such task"), None))
        assert table.claim("c", 0) is not None  # released: it never ran
    finally:
        ledger.close()
        table.close()
    tally = worker.tallies()
    assert tally.of("total") == {("t",): 3}
    assert tally.of("received") == tally.of("started") == {("t", "q"): 3}
    assert tally.of("succeeded") == {("t", "q"): 1}
    assert tally.of("failed") == {("t", "q", "KeyError"): 2}
    assert tally.of("dead_lettered") == {("q", "NotRegistered"): 1}
    assert tally.of("redelivered") == {("q",): 1}
    assert len(tally.runtimes[("t", "q")]) == 3


def test_a_requeued_dead_letter_runs_anew_inside_the_window_and_is_counted_once_where_it_ends(
    worker: _Worker,
):
    table = SharedDedupe.create(ttl_s=60.0, max_ids=64)
    ledger = FeedLedger(dedupe=SharedDedupe(table.path, ttl_s=60.0, owner=False), report_every_s=3600)
    requeued = {"x-clockwork-requeued": {"count": 1, "key": "k"}}
    try:
        ledger.report_to(worker.channel)
        assert _handle(ledger, "a", {"status": "SUCCESS"})  # its first run, before it was dead-lettered
        assert _handle(ledger, "a", {"status": "SUCCESS"}, headers=requeued)  # not a duplicate
        assert not _handle(ledger, "a", {"status": "SUCCESS"}, headers=requeued)  # a copy of the requeue is
        # A retry of a requeued task is a copy on its way, not its end; then it ends dead-lettered.
        with ledger.settling(_delivery({"x-clockwork-requeued": {"count": 2}})):
            assert not ledger.duplicate(_request("b"), redelivered=False)
            ledger.decided((Disposition.republish({"retries": 1}), None))
        with ledger.settling(_delivery({"x-clockwork-requeued": {"count": 2}})):
            assert not ledger.duplicate(_request("b", retries=1), redelivered=False)
            ledger.decided((Disposition.dead_letter("rejected", "no"), None))
    finally:
        ledger.close()
        table.close()
    assert worker.tallies().of("requeued") == {("q", "done"): 1, ("q", "dead_lettered"): 1}


def test_a_claim_ends_even_when_the_settle_fails_and_a_final_outcome_is_kept(worker: _Worker):
    table = SharedDedupe.create(ttl_s=60.0, max_ids=64)
    ledger = FeedLedger(dedupe=table)
    try:
        for task_id, disposition in (("ran", ACK), ("back", HAND_BACK)):
            with pytest.raises(ConnectionError), ledger.settling(_delivery()):
                assert not ledger.duplicate(_request(task_id), redelivered=False)
                ledger.decided((Disposition(disposition.fate, finished=disposition is ACK), None))
                raise ConnectionError("the ack did not go out")
        # The run that finished is remembered (the broker's copy is its duplicate); the other is not.
        assert table.claim("ran", 0) is None
        assert table.claim("back", 0) is not None
    finally:
        ledger.close()
    assert not worker.tallies()  # nothing counted without a worker to tell


def test_the_worker_sums_its_childrens_reports_and_drops_a_malformed_one():
    spec = FeedSpec(settings=Settings(), queues=("q",), prefetch=1, hostname="w@h", dedupe_window_s=5.0)
    feeding = Feeding(spec, slots=2)
    reported: list[Tally] = []
    feeding.on_tally = reported.append
    try:
        path = feeding.spec_for(1).dedupe_path
        assert path is not None and Path(path).exists()  # one window, named to every child
        assert feeding.spec_for(0).dedupe_path == path
        for n in (2, 3):
            tally = Tally()
            tally.count("total", "t", n=n)
            tally.count("succeeded", "t", "q", n=n)
            feeding.tallied(tally.to_frame())
        feeding.tallied({"op": "tally", "counts": [["total", "t"]]})
        assert feeding.totals == {"t": 5}
        assert [r.of("succeeded") for r in reported] == [{("t", "q"): 2}, {("t", "q"): 3}]
    finally:
        feeding.close()
    assert not Path(path).exists()
    without = Feeding(dataclasses.replace(spec, dedupe_window_s=None), slots=1)
    without.close()
    assert without.dedupe is None and without.spec_for(0).dedupe_path is None
