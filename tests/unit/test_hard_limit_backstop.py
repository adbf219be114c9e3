"""The worker's backstop for a consuming child's hard time limit (worker.pool.hard_limits).

Each "child" is a real process that shows a task on a real board and then sleeps, as a child
whose task holds the GIL would look from the worker: only a signal from outside ends it.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
from multiprocessing.synchronize import Event

from worker import ipc
from worker.pool.hard_limits import GRACE_S, HardLimitBackstop
from worker.shared.board import Board


def _show_then_hang(path: str, slots: int, slot: int, limit_s: float | None, shown: Event) -> None:
    board = Board.attach(path, slots)
    board.start(slot, {"id": f"task-{slot}", "name": "t.stuck", "time_limit": limit_s})
    shown.set()
    time.sleep(60)


def test_only_a_child_past_its_limit_and_the_grace_is_killed_once_and_every_child_told_first():
    board = Board.create(3)
    told: list[bytes] = []
    backstop = HardLimitBackstop(board, told.append)
    context = multiprocessing.get_context("fork")
    children, shown = [], []
    try:
        for slot, limit_s in enumerate((0.5, 30.0, None)):
            ready = context.Event()
            child = context.Process(target=_show_then_hang, args=(str(board.path), 3, slot, limit_s, ready))
            child.start()
            children.append(child)
            shown.append(ready)
        assert all(ready.wait(30) for ready in shown)
        first = time.monotonic()
        assert backstop.check(first) == []  # the first look: each run is timed from here
        assert backstop.check(first + 0.5 + GRACE_S - 0.1) == []  # within the grace still
        later = first + 0.5 + GRACE_S + 0.5  # past slot 0's limit and grace, well within slot 1's 30 s
        assert [entry.info["id"] for entry in backstop.check(later)] == ["task-0"]
        children[0].join(10)
        assert children[0].exitcode == -signal.SIGKILL
        assert children[1].is_alive() and children[2].is_alive()
        assert backstop.ended == {"task-0": 0.5}
        frames = [ipc.decode_frame(frame[ipc.HEADER.size :]) for frame in told]
        assert frames == [{"op": "timed_out", "id": "task-0", "limit": 0.5}]
        assert backstop.frames() == told  # what a child that starts later is told
        # Looked at again before the worker clears the dead child's slot: not signalled nor told twice.
        assert backstop.check(later) == []
        assert len(told) == 1
    finally:
        for child in children:
            child.kill()
            child.join(10)
        board.close()
