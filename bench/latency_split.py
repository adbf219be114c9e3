"""Where a round trip's time goes: our client and a raw pika client, each against our worker and a
raw pika echo worker, alternating in one run.

Usage: ``python -m bench.latency_split [--broker URL] [--calls 500] [--rounds 3] [-- WORKER ARGS]``
(or ``echo``, its raw worker); what follows ``--`` goes to our worker (``-- --threads 4``).
Prints one JSON line per pairing and round, then the medians as a table.

The echo worker is one pika process that answers each call with our result message for the call's
task id (encoded per call, a few microseconds), then acks; the raw client publishes our call message
(a fresh task id per call, as our client makes) and reads the reply queue without acks. Set against
each other, the pairings split our round trip's excess over raw pika's into the client's part and
the worker's part. ``pika+confirms`` is the raw client with its channel in confirm mode, confirms
read as they come and never waited for, as our client's are: the share of the publisher confirms,
which raw pika's ceiling (``bench.ceiling_pika``) does not pay.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from subprocess import Popen

import pika
from pika.adapters.blocking_connection import BlockingChannel
from pika.spec import Basic, BasicProperties

from bench import ceiling_pika
from bench.ceiling import (
    PREFETCH,
    ROOT,
    our_result_message,
    pika_properties,
    raw_worker_args,
    reply_queue,
    with_correlation_id,
)
from bench.control import vhost
from bench.ours import Clockwork
from bench.procs import running
from bench.queues import Depth, delete, probe
from bench.scenarios import Shape
from bench.stats import latency_ms
from broker_svc.logging import configure_logging
from broker_svc.wire.ids import uuid4_str

CLIENTS = ("ours", "pika", "pika+confirms")
WORKERS = ("ours", "pika")


def echo(url: str, queue: str) -> None:
    """Answer every call on ``queue`` with a SUCCESS result for its task id, then ack it."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=PREFETCH)
    channel.queue_declare(queue, durable=True)

    def on_call(ch: BlockingChannel, method: Basic.Deliver, props: BasicProperties, _body: bytes) -> None:
        task_id = str((props.headers or {}).get("id", props.correlation_id))
        reply = with_correlation_id(our_result_message(task_id), props.correlation_id)
        ch.basic_publish("", props.reply_to, reply.body, pika_properties(reply))
        ch.basic_ack(method.delivery_tag)

    channel.basic_consume(queue, on_call)
    channel.start_consuming()


def pika_client(url: str, queue: str, calls: int, *, confirms: bool = False) -> list[float]:
    """The raw pika client of ``bench.ceiling_pika``; ``measure`` deletes its reply queue."""
    return ceiling_pika.round_trip(url, queue, reply_queue(queue), calls, fresh_ids=True, confirms=confirms)


@contextmanager
def _worker(kind: str, url: str, queue: str, worker_args: list[str]) -> Iterator[Popen[bytes]]:
    if kind == "ours":
        with Clockwork(url, extra_worker_args=worker_args).worker(queue, Shape.PAIR) as proc:
            yield proc
        return
    cmd = [sys.executable, "-m", "bench.latency_split", "echo", "--broker", url, "--queue", queue]
    with running(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT) as proc:
        yield proc


def _consuming(depth: Depth) -> bool:
    return depth.consumers >= 1


def measure(url: str, client: str, worker: str, calls: int, worker_args: list[str]) -> dict[str, float]:
    """One pairing on a fresh queue: p50/p99 of ``calls`` round trips."""
    queue = f"split-{client}-{worker}-{uuid4_str()[:8]}"
    calls_by_client: dict[str, Callable[[str, str, int], list[float]]] = {
        "ours": lambda u, q, n: Clockwork(u).round_trip(q, n),
        "pika": pika_client,
        "pika+confirms": lambda u, q, n: pika_client(u, q, n, confirms=True),
    }
    call = calls_by_client[client]
    try:
        with probe(url) as queue_probe, _worker(worker, url, queue, worker_args) as proc:
            queue_probe.wait(
                queue, _consuming, timeout_s=120, what="worker start", alive=lambda: proc.poll() is None
            )
            return latency_ms(call(url, queue, calls))
    finally:
        delete(url, [queue, reply_queue(queue).name])


def main() -> int:
    raw = raw_worker_args("bench.latency_split", "echo")
    if raw is not None:
        echo(*raw)
        return 0
    argv = sys.argv[1:]
    worker_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m bench.latency_split", description=__doc__)
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    )
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(own)
    configure_logging("warning")
    # The queue probe polls a queue the worker has yet to declare: pika logs each 404 as a warning.
    logging.getLogger("pika.channel").setLevel(logging.ERROR)
    p50s: dict[tuple[str, str], list[float]] = {}
    with vhost(args.broker) as url:
        for round_no, (client, worker) in itertools.product(
            range(args.rounds), itertools.product(CLIENTS, WORKERS)
        ):
            figures = measure(url, client, worker, args.calls, worker_args)
            p50s.setdefault((client, worker), []).append(figures["p50_ms"])
            print(json.dumps({"round": round_no, "client": client, "worker": worker, **figures}), flush=True)
    print("\n| client \\ worker | ours | raw pika echo |\n|---|---|---|")
    for client in CLIENTS:
        cells = [f"{statistics.median(p50s[(client, worker)]):.2f} ms" for worker in WORKERS]
        print(f"| {'ours' if client == 'ours' else 'raw ' + client} | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
