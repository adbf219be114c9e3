"""One settle point: only worker/consume/settle.py, in the pool child that consumed it, acks, nacks or
rejects a task delivery (DESIGN §5)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("worker", "control", "broker_svc")
SETTLE_CALLS = frozenset({"ack", "nack", "reject", "basic_ack", "basic_nack", "basic_reject"})

# Where settling is allowed, and why: each entry is a file, never a folder, so a new module that
# settles anything has to be listed here with its reason.
ALLOWED = {
    # The settle point itself: every task delivery's disposition is carried out here, on the
    # consuming child's own connection.
    "worker/consume/settle.py",
    # Revocation-log stream entries, not task deliveries: a stream hands out more as these are acked.
    "worker/remote/revocation_log.py",
    # Park records read back from the scheduled stream (inspect scheduled), not task deliveries.
    "worker/remote/scheduled.py",
    # Members-stream events read by the control client (aio side), not task deliveries.
    "control/aio/broadcaster.py",
    # Members-stream events read by the blocking control client, not task deliveries.
    "control/blocking/members_feed.py",
    # Task-state records read by a client's state feed, not task deliveries.
    "broker_svc/connection/state_feed.py",
    # A scheduler's journal records (acked as read) and its snapshot (peeked: got, then requeued).
    "broker_svc/connection/beat_journal.py",
    # Chord parts, not task deliveries: acked in the transaction that sends their chord's body.
    "worker/single_active/chord_join.py",
    # Settled-chord markers read back from their stream by a joiner that became active: acked as read.
    "worker/single_active/settled_chords.py",
    # Tasks waiting for their dependencies (in the dependents queue, not a task queue): each acked
    # in the transaction that releases it; state records read from the stream.
    "worker/single_active/dependents.py",
    # Tasks at a dedup gate (in a gate shard queue, not a task queue) and the gate's own markers:
    # each acked in the transaction that sends it on, declines it or ends its key's head.
    "worker/single_active/gate_shard.py",
    # Members-stream events followed by a worker's dedup gate, not task deliveries.
    "control/aio/members_feed.py",
    # Election bids and term tokens, not task deliveries: a leader acks each token once the next
    # one is back (its lease), and bids as they come.
    "worker/leader/election.py",
    # Dead letters in <queue>.dead, not task deliveries: acked once their requeued copy is
    # confirmed, and requeue markers acked after their dead letter (ctl dead).
    "control/blocking/dead_letters.py",
}


def settle_calls(source: str, filename: str = "<source>") -> list[int]:
    """The lines of ``source`` that call ``.ack(``, ``.nack(``, ``.reject(`` or their ``basic_*`` forms."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source, filename=filename))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in SETTLE_CALLS
    )


def test_the_checker_finds_acks_nacks_and_rejects_on_any_object():
    source = (
        "async def handle(message, channel):\n"
        "    await message.ack()\n"
        "    await settle(message.nack(requeue=True))\n"
        "    message.reject(requeue=False)\n"
        "    channel.basic_ack(1)\n"
        "    acknowledge = message.ack\n"  # a reference, not a call
    )
    assert settle_calls(source) == [2, 3, 4, 5]


def test_the_checker_ignores_other_calls_named_alike():
    assert settle_calls("pending.settle(None)\nack()\nmessage.acked()\n") == []


def test_only_the_settle_point_settles_a_task_delivery():
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            lines = settle_calls(path.read_text(), filename=name)
            if lines and name not in ALLOWED:
                found[name] = lines
    assert found == {}, "decide a Disposition and let worker/consume/settle.py carry it out"


def test_every_allowed_file_still_settles_something():
    # A stale entry would let a later task-delivery ack in that file pass unnoticed.
    for name in sorted(ALLOWED):
        assert settle_calls((ROOT / name).read_text(), filename=name), name
