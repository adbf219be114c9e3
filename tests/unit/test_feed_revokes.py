"""A revoke command waits for every consuming child to apply the revoke (worker.pool.feeding).

The children here are the real control loop of a consuming child (``worker.child.serve``) on one
end of a socket pair, or a child the test answers for by hand, so it can be slow on purpose.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from structlog.testing import capture_logs

from broker_svc import Settings
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.consumer import Shared
from worker.child.serve import _follow_worker
from worker.child.spec import FeedSpec
from worker.pool.feeding import Feeding


@dataclass
class _Child:
    slot: int
    reader: asyncio.StreamReader  # the worker's end
    writer: asyncio.StreamWriter
    theirs: socket.socket  # the child's end


async def _join(feeding: Feeding, slot: int) -> _Child:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    feeding.joined(slot, writer)
    return _Child(slot, reader, writer, theirs)


async def _relay(feeding: Feeding, child: _Child) -> None:
    # The supervisor's part: a child's revoke_applied frames go to the feeding.
    while header := await child.reader.readexactly(ipc.HEADER.size):
        frame = ipc.decode_frame(await child.reader.readexactly(ipc.frame_length(header)))
        if frame["op"] == "revoke_applied":
            feeding.revoke_applied(child.slot, frame)


_SPEC = FeedSpec(settings=Settings(), queues=("q",), prefetch=1, hostname="w@h")


@pytest.fixture
async def feeding() -> AsyncIterator[Feeding]:
    made = Feeding(_SPEC, slots=2)
    try:
        yield made
    finally:
        made.close()


async def test_the_wait_ends_once_every_live_child_has_applied_the_revoke(feeding: Feeding):
    real, slow = await _join(feeding, 0), await _join(feeding, 1)
    shared = Shared(revoked=set(), wanted=["q"])
    control = threading.Thread(
        target=_follow_worker, args=(ChildChannel(real.theirs), shared, [], _SPEC), daemon=True
    )
    control.start()
    relays = [asyncio.create_task(_relay(feeding, child)) for child in (real, slow)]
    try:
        feeding.send_revoked(["a", "b"])
        waiting = asyncio.create_task(feeding.revokes_known(timeout_s=10.0))
        # The real child applies it and answers; the slow one has not yet, so the wait goes on.
        deadline = asyncio.get_running_loop().time() + 10.0
        while feeding._lagging(1) != [1]:
            assert asyncio.get_running_loop().time() < deadline, "the real child never answered"
            await asyncio.sleep(0.01)
        assert shared.revoked == {"a", "b"}
        assert not waiting.done()
        told = ChildChannel(slow.theirs).receive()
        assert told == {"op": "revoke", "ids": ["a", "b"], "seq": 1}
        ChildChannel(slow.theirs).send(ipc.encode_frame({"op": "revoke_applied", "seq": 1}))
        assert await asyncio.wait_for(waiting, 10.0) is True
        # Nothing new sent since: a second wait has nobody to wait for.
        assert await feeding.revokes_known(timeout_s=0.01) is True
    finally:
        for relay in relays:
            relay.cancel()
        for child in (real, slow):
            child.writer.close()
            await child.writer.wait_closed()
        await asyncio.to_thread(control.join, 10.0)  # end of file: the child's loop ends
        for child in (real, slow):
            child.theirs.close()
    assert not control.is_alive()


async def test_a_child_that_never_answers_times_out_and_one_that_exits_is_not_waited_for(feeding: Feeding):
    silent = await _join(feeding, 0)
    relay = asyncio.create_task(_relay(feeding, silent))
    try:
        feeding.send_revoked(["a"])
        with capture_logs() as logs:
            assert await feeding.revokes_known(timeout_s=0.2) is False
        # It never answered: still starting, which is said at info, not as a fault.
        assert [(e["log_level"], e["slots"], e["starting"]) for e in logs] == [("info", [0], [0])]
        waiting = asyncio.create_task(feeding.revokes_known(timeout_s=10.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert feeding.left(0) == []  # it exited: its answer will never come, nor is it needed
        assert await asyncio.wait_for(waiting, 10.0) is True
        # A malformed answer counts for nothing (and does not raise in the supervisor).
        again = await _join(feeding, 0)
        feeding.send_revoked(["b"])
        assert ChildChannel(again.theirs).receive() == {"op": "revoke", "ids": ["b"], "seq": 2}
        feeding.revoke_applied(0, {"op": "revoke_applied", "seq": "2"})
        # Its answer to the start-up orders, sent before any revoke (0): it has started all the same.
        feeding.revoke_applied(0, {"op": "revoke_applied", "seq": 0})
        with capture_logs() as logs:
            assert await feeding.revokes_known(timeout_s=0.1) is False
        assert [(e["log_level"], e["slots"], e["starting"]) for e in logs] == [("warning", [0], [])]
        again.writer.close()
        again.theirs.close()
    finally:
        relay.cancel()
        silent.writer.close()
        silent.theirs.close()


def test_a_starting_child_applies_every_frame_already_written_before_it_consumes():
    # The worker wrote the start-up orders, then a revoke, before the child's control thread ran:
    # the child must hold that revoke before its first task, whatever the threads' timing.
    ours, theirs = socket.socketpair()
    shared = Shared(revoked=set(), wanted=["q"])
    known_when_consuming: list[set[str]] = []

    class Recorded(threading.Event):
        def set(self) -> None:
            known_when_consuming.append(set(shared.revoked))
            super().set()

    shared.may_consume = Recorded()
    for frame in (
        {"op": "revoke", "ids": ["old"], "seq": 1},
        {"op": "consume"},
        {"op": "revoke", "ids": ["new"], "seq": 2},
    ):
        ours.sendall(ipc.encode_frame(frame))
    control = threading.Thread(
        target=_follow_worker, args=(ChildChannel(theirs), shared, [], _SPEC), daemon=True
    )
    control.start()
    try:
        assert shared.may_consume.wait(10.0)
        answers = ChildChannel(ours)
        assert [answers.receive(), answers.receive()] == [
            {"op": "revoke_applied", "seq": 1},
            {"op": "revoke_applied", "seq": 2},
        ]
    finally:
        ours.close()
        control.join(10.0)
        theirs.close()
    assert known_when_consuming[0] == {"old", "new"}
    assert not control.is_alive()
