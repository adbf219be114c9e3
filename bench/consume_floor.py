"""The floor of consuming alone: consume + ack with pika against a consuming child's own connection.

Usage: ``python -m bench.consume_floor [--broker URL] [--messages 20000] [--processes 2]
[--prefetch 1] [--rounds 3] [--threads N]``. In a vhost of its own, fills a queue with the messages (our no-op
task's bytes) and drains it with ``--processes`` processes, each consuming with ``--prefetch``
unacked and acking each message, nothing else: once with pika's ``BlockingConnection`` (what
Dramatiq's workers use) and once with ``broker_svc.amqp.feed_connection.FeedConnection``
(what a consuming pool child uses), alternating. Prints one JSON line per round and
client: messages/s from the first process start to the last exit. With ``--threads N`` (N > 1) the
clients are instead what a ``--threads N`` child consumes with: N threads each with a
``FeedConnection`` of its own at ``--prefetch`` (before issue 16's step), N threads sharing one
``SharedFeedConnection`` at N × ``--prefetch``, and one thread alone on that connection.

Why: it shows how much of a consuming child's time the AMQP client itself takes, the reason the
child has a connection of its own rather than pika (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable

import pika

from bench.control import vhost
from bench.ours import Clockwork
from bench.queues import delete
from bench.scenarios import Task
from broker_svc import Settings
from broker_svc.amqp.feed_connection import FeedConnection
from broker_svc.amqp.shared_feed_connection import SharedFeedConnection
from broker_svc.logging import configure_logging
from broker_svc.wire.ids import uuid4_str


def _pika(url: str, queue: str, count: int, prefetch: int) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=prefetch)
    done = 0
    for method, _props, _body in channel.consume(queue):
        channel.basic_ack(method.delivery_tag)
        done += 1
        if done >= count:
            break
    channel.cancel()
    connection.close()


def _feed(url: str, queue: str, count: int, prefetch: int) -> None:
    connection = FeedConnection(Settings(broker_url=url), name="floor", queues=[queue], prefetch=prefetch)
    connection.connect()
    done = 0
    while done < count:
        delivery = connection.next_delivery(10.0)
        if delivery is None:
            break
        connection.ack(delivery)
        done += 1
    connection.close()


def _in_threads(
    threads: int, count: int, take: Callable[[], FeedConnection], done: Callable[[FeedConnection], None]
) -> None:
    # ``threads`` threads consume and ack ``count`` messages between them, each from ``take()``,
    # and ``done`` with it (a connection of its own is closed at once: what it prefetched goes to
    # the threads still consuming).
    left, lock = [count], threading.Lock()

    def run() -> None:
        connection = take()
        try:
            while True:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                delivery = connection.next_delivery(10.0)
                if delivery is None:
                    return
                connection.ack(delivery)
        finally:
            done(connection)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _per_thread(url: str, queue: str, count: int, prefetch: int, threads: int) -> None:
    def take() -> FeedConnection:
        connection = FeedConnection(Settings(broker_url=url), name="floor", queues=[queue], prefetch=prefetch)
        connection.connect()
        return connection

    _in_threads(threads, count, take, lambda connection: connection.close())


def _shared(url: str, queue: str, count: int, prefetch: int, threads: int) -> None:
    connection = SharedFeedConnection(
        Settings(broker_url=url), name="floor", queues=[queue], prefetch=prefetch * threads
    )
    connection.connect()
    _in_threads(threads, count, lambda: connection, lambda _: None)
    connection.close()


def _shared_one_thread(url: str, queue: str, count: int, prefetch: int, threads: int) -> None:
    connection = SharedFeedConnection(
        Settings(broker_url=url), name="floor", queues=[queue], prefetch=prefetch * threads
    )
    connection.connect()
    _in_threads(1, count, lambda: connection, lambda _: None)
    connection.close()


CLIENTS = {"pika": _pika, "feed_connection": _feed}
THREADED_CLIENTS = {
    "connection_per_thread": _per_thread,
    "shared_connection": _shared,
    "shared_connection_one_thread": _shared_one_thread,
}


def one_round(
    url: str, client: str, messages: int, processes: int, prefetch: int, threads: int = 1
) -> dict[str, object]:
    queue = f"floor-{uuid4_str()[:8]}"
    Clockwork(url).fill(queue, messages, Task.NOOP)
    try:
        context = multiprocessing.get_context("spawn")
        share = messages // processes
        workers = [
            context.Process(target=THREADED_CLIENTS[client], args=(url, queue, share, prefetch, threads))
            if threads > 1
            else context.Process(target=CLIENTS[client], args=(url, queue, share, prefetch))
            for _ in range(processes)
        ]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(300)
        seconds = time.perf_counter() - started
        rate = round(share * processes / seconds, 1)
        return {
            "client": client, "messages_per_s": rate, "prefetch": prefetch, "processes": processes,
            "threads": threads,
        }  # fmt: skip
    finally:
        delete(url, [queue])


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.consume_floor", description=__doc__)
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="consuming threads per process (see above)")
    args = parser.parse_args()
    configure_logging("warning")
    with vhost(args.broker) as url:
        for _ in range(args.rounds):
            for client in THREADED_CLIENTS if args.threads > 1 else CLIENTS:
                measured = one_round(url, client, args.messages, args.processes, args.prefetch, args.threads)
                print(json.dumps(measured), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
