"""A consuming pool child's loop: its own connection, its deliveries one at a time, its time limits.

The main thread does the work (``worker/child/consumer.py``): it reads a delivery from the child's
``FeedConnection``, takes it from decode to ack (``FeedHandler`` → ``FeedSettler``) and runs the
task body on the way, so the soft time limit (SIGALRM) lands in the task. No thread hands a
delivery to another.

With ``--threads N`` the child runs N such consumers, each in a thread of its own, on one connection
(``SharedFeedConnection``: one channel, one consumer per queue, prefetch N times the prefetch
multiplier, so every delivery the child holds has a thread free to run it); the main thread waits
for them, then closes it. Their soft time limits come from ``thread_limits`` (a signal reaches only
the main thread); a hard time limit or a terminate still ends the whole child, and what its other
threads held goes back to the queues as redeliveries.

Beside it:

- the connection's heartbeat thread writes heartbeats while a task runs;
- a control thread reads the worker's socket: "consume" once the worker knows every revoke,
  revoked ids as it learns them (each answered "revoke_applied": a revoke command replies after),
  and end of file or "retire" (the pool shrank), which mean stop:
  the task running ends, what was delivered and not started is handed back, the child exits;
  "held" (inspect reserved), answered with what the connection holds unstarted (``held.py``);
  "timed_out": a task whose child the worker ended past its hard limit (its copy is answered so);
  "report" (inspect stats): the counts not reported yet, then "reported";
  and, under ``--threads``, "cancel": the worker's terminate of an ``async def`` task, which its
  thread's loop cancels (``worker/child/task_loop.py``) while the other threads go on;
- the hard time limit's watchdog (``worker/child/hard_limit.py``), started on the first task that
  has one: past the limit it takes the socket over, answers FAILURE ``TimeLimitExceeded``, acks,
  and ends the child (the pool starts another).

A lost connection is connected again with a backoff; what it had delivered goes back to the queues.
When it is lost after a run, before the ack went through, the child connects again at once and sends
the run's outcome, and a copy the broker sends back to any child of the worker is joined to that
run, not run again (``worker/child/redeliveries.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import structlog

from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from broker_svc.app import App
from broker_svc.clock import LamportClock
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.consumer import STOP_CHECK_S, Consumer, Shared
from worker.child.hard_limit import signals_blocked
from worker.child.held import held_frame
from worker.child.redeliveries import RecentRuns
from worker.child.soft_limits import SoftLimit, ThreadSoftLimits
from worker.child.spec import FeedSpec
from worker.consume.settle import CopiesInFlight
from worker.rules.prefetch_budget import PrefetchBudget
from worker.shared.board import Board

__all__ = ["build_consumers", "serve"]

log = structlog.get_logger(__name__)

# The runs a child remembers, per thread: those whose acks a lost connection may have taken are
# among the last few each thread settled (worker/child/redeliveries.py).
_RECENT_RUNS_PER_THREAD = 32


def serve(app: App, spec: FeedSpec, channel: ChildChannel, soft_limit: SoftLimit) -> None:
    """Consume ``spec.queues`` and run their tasks here until the worker closes the socket."""
    budget = None
    if spec.prefetch_budget_s is not None:
        budget = PrefetchBudget(
            spec.prefetch_budget_s, threads=spec.threads, current=spec.connection_prefetch
        )
    shared = Shared(revoked=set(spec.revoked), wanted=list(spec.queues), budget=budget)
    clock = LamportClock()
    board = Board.attach(spec.board_path, spec.board_slots) if spec.board_path else None
    if spec.threads == 1:
        signal.signal(signal.SIGALRM, soft_limit.on_signal)  # the soft limit: a SIGALRM to this thread
    consumers, connection = build_consumers(
        app, spec, shared, clock=clock, board=board, soft_limit=soft_limit
    )
    for consumer in consumers:
        consumer.handler.time_limits = shared.time_limits  # one table for every thread
        consumer.handler.ledger.report_to(channel)  # its counts, for the worker's stats and metrics
    with signals_blocked():  # the threads started here never take the main thread's signals
        control = threading.Thread(
            target=_follow_worker, args=(channel, shared, consumers, spec),
            name="clockwork-feed-control", daemon=True,
        )  # fmt: skip
        control.start()
    retired = threading.Event()

    def retiring() -> None:  # once, whichever thread found the child worn out
        if not retired.is_set():
            retired.set()
            shared.stopping.set()
            _say_retiring(channel)

    shared.may_consume.wait()
    if len(consumers) == 1:
        consumers[0].run(retiring)
        return
    with signals_blocked():
        threads = [
            threading.Thread(target=c.run, args=(retiring,), name=f"clockwork-feed-{c.index}", daemon=True)
            for c in consumers
        ]
        for thread in threads:
            thread.start()
    for thread in threads:
        while thread.is_alive():  # joined in steps, so the main thread still takes its signals
            thread.join(STOP_CHECK_S)
    if connection is not None:
        connection.close()


def build_consumers(
    app: App,
    spec: FeedSpec,
    shared: Shared,
    *,
    clock: LamportClock,
    board: Board | None,
    soft_limit: SoftLimit,
) -> tuple[list[Consumer], SharedFeedConnection | None]:
    """The child's consumers: one on a connection of its own, or ``spec.threads`` on one shared one.

    ``soft_limit`` is the single consumer's (the caller routes SIGALRM to it); threads get theirs
    from ``ThreadSoftLimits``. The shared connection is returned for the caller to close.
    """
    recent = RecentRuns(_RECENT_RUNS_PER_THREAD * spec.threads)  # one for the child's threads
    if spec.threads == 1:
        consumer = Consumer(
            app, spec, shared, clock=clock, board=board, index=0, soft_limit=soft_limit, recent=recent
        )
        return [consumer], None
    limits = ThreadSoftLimits()
    copies = CopiesInFlight(timeout_s=spec.settings.confirm_timeout_s)
    connection = SharedFeedConnection(
        spec.settings, name=spec.connection_name(os.getpid()), queues=spec.queues,
        prefetch=spec.connection_prefetch, declare=spec.queue_specs,
    )  # fmt: skip
    consumers = [
        Consumer(
            app,
            spec,
            shared,
            clock=clock,
            board=board,
            index=i,
            soft_limit=limits.for_thread(),
            connection=connection,
            recent=recent,
            copies=copies,
        )  # fmt: skip
        for i in range(spec.threads)
    ]
    return consumers, connection


def _say_retiring(channel: ChildChannel) -> None:
    # The pool then replaces this child without a warning that it died.
    with contextlib.suppress(OSError):
        channel.send(ipc.encode_frame({"op": "retiring"}))


def _follow_worker(channel: ChildChannel, shared: Shared, consumers: list[Consumer], spec: FeedSpec) -> None:
    # "consume" once the worker knows every revoke (its state file, the log, Mingle); revoked ids
    # as it learns them; end of file (the worker closed our socket): stop.
    consume = False
    try:
        while (frame := channel.receive()) is not None:
            op = frame.get("op")
            if op == "consume":
                consume = True
            elif op == "timed_out":  # the worker ended the child running it past its hard limit
                shared.timed_out[str(frame.get("id"))] = float(frame.get("limit") or 0.0)
            elif op == "terminated":  # the worker ends the child running it: its copy is answered so
                shared.terminated[str(frame.get("id"))] = int(frame.get("signum") or 15)
                shared.revoked.add(str(frame.get("id")))
            elif op == "revoke":
                shared.revoked.update(str(task_id) for task_id in frame.get("ids") or ())
                if isinstance(stamps := frame.get("stamps"), dict):
                    shared.revoked_stamps.add(stamps)
                # Applied: the worker may now answer the revoke command that sent it.
                channel.send(ipc.encode_frame({"op": "revoke_applied", "seq": frame.get("seq", 0)}))
            elif op == "cancel":  # terminate of an async def task under --threads: in its thread
                for consumer in consumers:
                    consumer.task_loop.cancel(str(frame.get("id")))
            elif op == "events":  # enable_events / disable_events
                for consumer in consumers:
                    consumer.events.enabled = bool(frame.get("on"))
            elif op == "queues":  # add_consumer / cancel_consumer: each consumer applies it
                shared.wanted[:] = [str(queue) for queue in frame.get("queues") or ()]
            elif op == "time_limit":  # the time_limit command: (hard, soft) for one task
                shared.time_limits[str(frame.get("task"))] = (frame.get("hard"), frame.get("soft"))
            elif op == "held":  # inspect reserved: what this child holds and has not started
                channel.send(
                    held_frame(consumers[0].connection, spec.settings, seq=frame.get("seq"), pid=os.getpid())
                )
            elif op == "report":  # inspect stats: the counts not reported yet, then the answer after them
                for consumer in consumers:
                    consumer.handler.ledger.report()
                channel.send(ipc.encode_frame({"op": "reported", "seq": frame.get("seq")}))
            elif op == "retire":  # the pool shrank: stop as on end of file, but the worker waits for us
                shared.stopping.set()
                shared.may_consume.set()
            else:
                log.warning("feed_child_unknown_frame", op=op)
            # Consume only once every frame already written is applied: a revoke the worker sent
            # while this child started is known before its first task (the worker's revoke
            # command may be waiting for this child's answer to it).
            if consume and not channel.readable():
                shared.may_consume.set()
                consume = False
    except OSError:
        pass
    finally:
        shared.stopping.set()
        shared.may_consume.set()
