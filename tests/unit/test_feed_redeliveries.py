"""What a consuming child makes of a copy the broker sends back (worker.child.redeliveries)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc.amqp.feed_connection import ConnectionLost, FeedConnection, TaskDelivery
from broker_svc.settings import Settings
from worker.child.redeliveries import FeedRedeliveries, RecentRuns, Verdict
from worker.rules.disposition import Fate
from worker.shared.board import Board
from worker.shared.dedupe import SharedDedupe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def board() -> Iterator[Board]:
    shared = Board.create(4)
    yield shared
    shared.close()


@pytest.fixture
def done() -> Iterator[SharedDedupe]:
    shared = SharedDedupe.create(ttl_s=60.0, max_ids=64, kind="redeliveries")
    yield shared
    shared.close()


def _view(
    board: Board,
    done: SharedDedupe,
    own_slot: int,
    *,
    connection: FeedConnection | None = None,
    recent: RecentRuns | None = None,
) -> FeedRedeliveries:
    # Never connected: verdict reads only the shared files.
    connection = connection or FeedConnection(Settings(), name="unit", queues=[], prefetch=1)
    return FeedRedeliveries(board=board, done=done, own_slot=own_slot, connection=connection, recent=recent)


def test_a_copy_of_a_task_another_slot_runs_waits(board: Board, done: SharedDedupe):
    board.start(2, {"id": "t1", "name": "x"})
    assert _view(board, done, own_slot=0).verdict("t1", 0) is Verdict.RUNNING
    # Its own slot is not a copy's first run (it settled what it ran before it reads again).
    assert _view(board, done, own_slot=2).verdict("t1", 0) is Verdict.RUN
    board.end(2)
    assert _view(board, done, own_slot=0).verdict("t1", 0) is Verdict.RUN


def test_a_copy_of_a_task_shown_by_a_dead_process_runs(board: Board, done: SharedDedupe):
    # A child shows the task, then dies without clearing its slot (the worker has not yet).
    shows = (
        "from worker.shared.board import Board;"
        f"Board.attach({str(board.path)!r}, {board.slots}).start(1, {{'id': 't2'}})"
    )
    subprocess.run([sys.executable, "-c", shows], check=True, cwd=ROOT)
    assert [running.info["id"] for running in board.running()] == ["t2"]
    assert _view(board, done, own_slot=0).verdict("t2", 0) is Verdict.RUN


def test_an_outcome_being_sent_again_waits_then_the_copy_is_acked(board: Board, done: SharedDedupe):
    view = _view(board, done, own_slot=0)
    claim = view.sending_outcome("t3", 1)
    assert view.verdict("t3", 1) is Verdict.RUNNING
    view.outcome_sent(claim, sent=True)
    assert view.verdict("t3", 1) is Verdict.DONE
    assert view.verdict("t3", 0) is Verdict.RUN  # an earlier attempt is another key


def test_an_outcome_that_could_not_be_sent_lets_the_copy_run(board: Board, done: SharedDedupe):
    view = _view(board, done, own_slot=0)
    view.outcome_sent(view.sending_outcome("t4", 0), sent=False)
    assert view.verdict("t4", 0) is Verdict.RUN


def _delivery(task_id: str, *, generation: int) -> TaskDelivery:
    return TaskDelivery(
        body=b"", queue="q", routing_key="q", exchange="", redelivered=False, tag=1, generation=generation,
        content_type=None, content_encoding=None, headers={"id": task_id, "retries": 0}, correlation_id=None,
        reply_to=None, priority=None,
    )  # fmt: skip


def test_a_threaded_childs_runs_on_a_lost_connection_are_finished_before_it_connects_again(
    board: Board, done: SharedDedupe
):
    # Under --threads nobody reads after an ack: the last runs settled on a connection are taken
    # as done when it is lost, so a copy sent back because its ack was lost is acked unrun.
    connection = FeedConnection(Settings(), name="unit", queues=[], prefetch=1)
    connection.generation = 1  # as if connected once
    view = _view(board, done, own_slot=0, connection=connection, recent=RecentRuns(8))
    view.settled(_delivery("r1", generation=1), Fate.ACK, ran=True)
    view.settled(_delivery("r2", generation=1), Fate.HAND_BACK, ran=True)  # back to the queue: runs again
    view.settled(_delivery("r3", generation=1), None, ran=True)  # the hard limit's watchdog settled it
    view.settled(_delivery("r4", generation=1), Fate.ACK, ran=False)  # refused, never ran
    assert view.verdict("r1", 0) is Verdict.RUN  # nothing is written while the connection lives
    lost = ConnectionLost("closed")
    lost.generation = 1
    view.connection_lost(lost)
    assert [view.verdict(task_id, 0) for task_id in ("r1", "r2", "r3", "r4")] == [
        Verdict.DONE,
        Verdict.RUN,
        Verdict.RUN,
        Verdict.RUN,
    ]
    # A run settled after the loss was told (a close seen while threads ran, nobody reconnected
    # yet): its ack went to a connection the broker had closed, so it is done at once.
    view.settled(_delivery("r8", generation=1), Fate.ACK, ran=True)
    assert view.verdict("r8", 0) is Verdict.DONE
    # A run settled on the old connection after another thread connected again: done at once.
    connection.generation = 2
    view.settled(_delivery("r5", generation=1), Fate.ACK, ran=True)
    assert view.verdict("r5", 0) is Verdict.DONE
    # The new connection's runs are not the lost one's.
    view.settled(_delivery("r6", generation=2), Fate.ACK, ran=True)
    view.connection_lost(lost)
    assert view.verdict("r6", 0) is Verdict.RUN


def test_a_consumer_that_reads_after_each_ack_keeps_no_runs(board: Board, done: SharedDedupe):
    connection = FeedConnection(Settings(), name="unit", queues=[], prefetch=1)
    connection.generation = 1
    view = _view(board, done, own_slot=0, connection=connection)
    view.settled(_delivery("r7", generation=1), Fate.ACK, ran=True)
    lost = ConnectionLost("closed")
    lost.generation = 1
    view.connection_lost(lost)
    assert view.verdict("r7", 0) is Verdict.RUN
