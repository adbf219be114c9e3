"""A threaded child's copies in flight (worker.consume.settle.CopiesInFlight): a sibling that takes a
copy waits for its original's ack. R2 under ``--threads`` checks it against a real broker
(tests/reliability/test_delivery_limit.py)."""

from __future__ import annotations

import threading
import time

from broker_svc.amqp.feed_connection import TaskDelivery
from worker.consume.settle import CopiesInFlight


def _delivery(task_id: object) -> TaskDelivery:
    return TaskDelivery(
        body=b"", queue="q", routing_key="q", exchange="", redelivered=False, tag=1, generation=1,
        content_type=None, content_encoding=None, headers={"id": task_id}, correlation_id=None,
        reply_to=None, priority=None,
    )  # fmt: skip


def _returns_at_once(copies: CopiesInFlight, *task_ids: object) -> None:
    started = time.monotonic()
    for task_id in task_ids:
        copies.wait_for_original(_delivery(task_id))
    assert time.monotonic() - started < 0.1, task_ids


def test_a_copy_waits_until_its_original_is_acked_and_no_longer():
    copies = CopiesInFlight(timeout_s=10.0)
    acked = threading.Event()
    waited: list[float] = []

    def sibling() -> None:
        started = time.monotonic()
        copies.wait_for_original(_delivery("t1"))
        waited.append(time.monotonic() - started)
        assert acked.is_set(), "the copy went on before its original was acked"

    with copies.copying(_delivery("t1")):
        thread = threading.Thread(target=sibling)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive(), "the copy did not wait"
        acked.set()
    thread.join(5)
    assert not thread.is_alive() and len(waited) == 1 and waited[0] >= 0.3
    _returns_at_once(copies, "t1")  # acked: nothing to wait for


def test_other_ids_and_odd_ones_never_wait_and_a_failed_settle_ends_the_wait():
    copies = CopiesInFlight(timeout_s=10.0)
    with copies.copying(_delivery("t1")):
        _returns_at_once(copies, "t2", None, ["t1"])
    try:
        with copies.copying(_delivery("t3")):
            raise ConnectionError("the copy's confirm was lost")
    except ConnectionError:
        pass
    _returns_at_once(copies, "t3")


def test_the_wait_is_bounded():
    copies = CopiesInFlight(timeout_s=0.2)
    with copies.copying(_delivery("t1")):
        started = time.monotonic()
        copies.wait_for_original(_delivery("t1"))
        assert 0.2 <= time.monotonic() - started < 2.0
