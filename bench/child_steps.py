"""A consuming child's task path step by step, in this process, with no broker: µs of CPU per step.

Usage: ``python -m bench.child_steps [--calls 5000] [--repeat 5]``. Builds the child's
``FeedHandler`` as ``bench.child_inproc`` does (its connection never connects: a no-op task with
``ignore_result`` sends nothing) and times, on one encoded no-op task (``bench.tasks.noop``, the
headers and body our client sends), each step of ``FeedHandler.handle`` and the line logged after
the ack: the content header's decoding and the task's (``decode``), the guards before a run
(``guards``), the run with its request, signals and hooks (``run``), the outcome with its tallies
(``outcome``), the ``task_succeeded`` line (``log``, JSON to a file, as the worker writes it), and
``handle`` whole (the first four, and the log context). Prints one JSON line: the best of
``--repeat`` rounds of ``--calls`` calls, in µs of this process's CPU per call.

To compare two commits, run it from two checkouts (``PYTHONPATH=<checkout>``) in turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.tasks import app as bench_app
from broker_svc.amqp import frames
from broker_svc.amqp.methods import Deliver
from broker_svc.amqp.peek import task_delivery
from broker_svc.clock import LamportClock
from broker_svc.logging import configure_logging
from broker_svc.settings import Settings
from broker_svc.topology import task_queue
from broker_svc.wire.amqp_fields import encode_properties
from broker_svc.wire.task.task_message import TaskMessage, decode_task, encode_task
from worker.child.consumer import Shared
from worker.child.serve import build_consumers
from worker.child.soft_limits import SoftLimit
from worker.child.spec import FeedSpec
from worker.consume.handle import FeedHandler
from worker.rules.disposition import ACK

_QUEUE = "child-steps"
_NAME = "bench.tasks.noop"


def _header_payload() -> tuple[bytes, bytes]:
    # The content header frame's payload and the body of a no-op task as our client sends it.
    message = TaskMessage(id=TaskMessage.new_id(), task=_NAME, ignore_result=True)
    wire = encode_task(message, serializer="json")
    properties = encode_properties(
        content_type=wire.content_type, content_encoding=wire.content_encoding, headers=wire.headers,
        delivery_mode=wire.delivery_mode, priority=wire.priority, correlation_id=wire.correlation_id,
        reply_to=wire.reply_to,
    )  # fmt: skip
    return struct.pack(">HHQ", 60, 0, len(wire.body)) + properties, wire.body


def _handler() -> FeedHandler:
    spec = FeedSpec(
        settings=Settings(), queues=(_QUEUE,), prefetch=1, hostname="steps@bench",
        queue_specs=(task_queue(_QUEUE),), task_names=(_NAME,),
    )  # fmt: skip
    shared = Shared(revoked=set(), wanted=[_QUEUE])
    consumers, _ = build_consumers(
        bench_app, spec, shared, clock=LamportClock(), board=None, soft_limit=SoftLimit()
    )
    return consumers[0].handler


def _best(calls: int, repeat: int, step: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        for _ in range(calls):
            step()
        best = min(best, (time.process_time() - started) / calls * 1e6)
    return round(best, 1)


def measure(calls: int, repeat: int) -> dict[str, float]:
    """Each step's best µs of CPU per call."""
    handler = _handler()
    payload, body = _header_payload()
    deliver = Deliver("ctag", 1, False, "", _QUEUE)
    properties = frames.decode_properties(payload)
    delivery = task_delivery(deliver, properties, body, _QUEUE, 1)
    accept = handler._accept
    settings = handler._settings

    def decode() -> Any:
        got = frames.decode_properties(payload)
        one = task_delivery(deliver, got, body, _QUEUE, 1)
        return decode_task(
            one.body, one.headers, content_type=one.content_type, accept=accept,
            max_bytes=settings.max_body_bytes, correlation_id=one.correlation_id,
            reply_to=one.reply_to, priority=one.priority,
        )  # fmt: skip

    request = decode()
    execute = handler._execute

    def guards() -> Any:
        handler._execute = lambda _delivery, _request: (ACK, None)  # type: ignore[method-assign,assignment]
        try:
            return handler._guarded(delivery, request)
        finally:
            handler._execute = execute  # type: ignore[method-assign]

    outcomes = handler._outcomes
    conclude = outcomes.conclude
    done_frames: list[tuple[Any, Any, float]] = []

    def keep(request: Any, done: Any, runtime_ms: float) -> Any:
        done_frames.append((request, done, runtime_ms))
        return ACK, None

    def run() -> Any:
        outcomes.conclude = keep  # type: ignore[method-assign]
        try:
            return execute(delivery, request)
        finally:
            outcomes.conclude = conclude  # type: ignore[method-assign]

    run()
    frame = done_frames[-1]

    def outcome() -> Any:
        return handler.ledger.decided(conclude(*frame))

    def log() -> None:
        outcomes.succeeded_ms = 0.123
        handler.log_success()

    def handle() -> Any:
        return handler.handle(delivery)

    figures = {
        "decode": _best(calls, repeat, decode),
        "guards": _best(calls, repeat, guards),
        "run": _best(calls, repeat, run),
        "outcome": _best(calls, repeat, outcome),
        "log": _best(calls, repeat, log),
        "handle": _best(calls, repeat, handle),
    }
    figures["handle_and_log"] = round(figures["handle"] + figures["log"], 1)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.child_steps", description=__doc__)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", prefix="bench-child-steps-", suffix=".log") as log:
        with contextlib.redirect_stderr(log):  # the lines go to a file, as the worker's do
            configure_logging("info", json=True)
            figures = measure(args.calls, args.repeat)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
