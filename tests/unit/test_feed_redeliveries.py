"""What a consuming child makes of a copy the broker sends back (worker.feed.redeliveries.verdict)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc.connection.feed_connection import FeedConnection
from broker_svc.settings import Settings
from worker.feed.dedupe import SharedDedupe
from worker.feed.redeliveries import FeedRedeliveries, Verdict
from worker.pool.board import Board

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


def _view(board: Board, done: SharedDedupe, own_slot: int) -> FeedRedeliveries:
    # Never connected: verdict reads only the shared files.
    connection = FeedConnection(Settings(), name="unit", queues=[], prefetch=1)
    return FeedRedeliveries(board=board, done=done, own_slot=own_slot, connection=connection)


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
        "from worker.pool.board import Board;"
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
