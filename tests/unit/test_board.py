"""The shared board of what consuming children run: written by a child, read by the worker."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from worker.shared.board import Board


def _run_in_child(path: str, slots: int, slot: int, task_id: str) -> None:
    board = Board.attach(path, slots)
    board.start(slot, {"id": task_id, "name": "t", "args": [1, "x"], "kwargs": {"k": None}})
    board.close()


def test_a_slot_written_in_another_process_is_read_whole_and_cleared():
    board = Board.create(3)
    try:
        child = multiprocessing.get_context("spawn").Process(
            target=_run_in_child, args=(str(board.path), 3, 1, "abc")
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        running = board.running()
        assert [(r.slot, r.info["id"], r.info["args"], r.pid) for r in running] == [
            (1, "abc", [1, "x"], child.pid)
        ]
        assert running[0].started > 0
        board.clear(1)
        assert board.running() == []
    finally:
        board.close()
    assert not board.path.exists()  # the worker's board removes its file
    assert board.running() == []  # and reads as empty once closed


def test_big_arguments_are_shown_as_their_reprs_cut_short():
    board = Board.create(1)
    try:
        board.start(0, {"id": "big", "args": ["x" * 50_000], "kwargs": {}})
        (entry,) = board.running()
        assert entry.info["id"] == "big" and isinstance(entry.info["args"], str)
        assert len(entry.info["args"]) <= 1000 and entry.pid == os.getpid()
        board.end(0)
        assert board.running() == []
    finally:
        board.close()


def test_each_slot_counts_the_tasks_its_child_ended():
    board = Board.create(2)
    try:
        for _ in range(3):
            board.start(1, {"id": "x"})
            board.end(1)
        assert board.ended(1) == 3 and board.ended(0) == 0
    finally:
        board.close()
    assert board.ended(1) == 0  # closed: nothing to read


def test_a_grown_board_keeps_what_its_slots_show_and_children_attached_before_still_write():
    board = Board.create(1)
    early = Board.attach(str(board.path), 1)  # a child that attached at the start-up size
    try:
        early.start(0, {"id": "before"})
        board.grow(3)
        assert board.slots == 3 and board.path.stat().st_size == 3 * 8192
        late = Board.attach(str(board.path), board.slots)
        late.start(2, {"id": "after"})
        early.end(0)
        early.start(0, {"id": "again"})
        assert [(r.slot, r.info["id"]) for r in board.running()] == [(0, "again"), (2, "after")]
        assert board.ended(0) == 1
        board.grow(2)  # room already: nothing changes
        assert board.slots == 3
        late.close()
    finally:
        early.close()
        board.close()
    assert not board.path.exists()


def test_only_the_worker_grows_the_board():
    board = Board.create(1)
    child = Board.attach(str(board.path), 1)
    try:
        with pytest.raises(RuntimeError, match="worker"):
            child.grow(2)
    finally:
        child.close()
        board.close()
