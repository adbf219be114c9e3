"""Load is balanced at three levels: child, worker and queue, each with a bound that can fail."""

from __future__ import annotations

import time

from broker_svc import App, Settings
from broker_svc.tasks.task import Signature
from tests.support.amqp import delete_queues, queue_depth
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

TIMED = "tests.integration.e2e_tasks.timed"
NOOP = "tests.integration.e2e_tasks.noop"
KILL_CHILD = "tests.integration.e2e_tasks.kill_child"


def test_short_tasks_never_wait_behind_a_long_one_in_the_same_worker(
    test_vhost_url: str, queue: str, client: App
):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        long = client.send_task(TIMED, args=(10.0,), queue=queue)
        sent = time.time()
        shorts = [client.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(100)]
        ends = [r.get(timeout=30)[1] for r in shorts]
        # 100 x 10 ms is 1 s of work for the one free child; the long task holds only its own.
        assert max(ends) - sent < 3.0, max(ends) - sent
        assert not long.ready()
        call(test_vhost_url, "revoke", arguments={"task_id": long.id, "terminate": True},
             destination=[worker.name], expect=1)  # fmt: skip


def test_a_busy_worker_hoards_nothing_an_idle_one_could_run(test_vhost_url: str, queue: str, client: App):
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as busy:
        busy.wait_ready()
        # Both long tasks go to the only worker there is; it is busy when the idle one starts.
        longs = [client.send_task(TIMED, args=(8.0,), queue=queue) for _ in range(2)]
        wait_for(lambda: _running(test_vhost_url) == 2, timeout_s=15, message="both long tasks running")
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as idle:
            idle.wait_ready()
            sent = time.time()
            shorts = [client.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(60)]
            waits = sorted(r.get(timeout=30)[0] - sent for r in shorts)
            long_ends = [r.get(timeout=30)[1] for r in longs]
    # No short task waited for a long one to end: the busy worker held none back (Celery's
    # prefetch of 4 per child makes 8 of them wait for the long tasks here).
    assert min(long_ends) - sent > 2.0  # the long tasks were still running
    assert waits[-1] < 1.5, waits
    print(f"short-task start delay: p50 {waits[len(waits) // 2]:.3f} s, max {waits[-1]:.3f} s")


def _running(url: str, workers: int = 1) -> int:
    replies = call(url, "active", expect=workers, wait_s=2)
    return sum(len(value) for _, body in replies for value in body.values())


def test_a_small_queue_is_served_while_a_big_one_waits(test_vhost_url: str):
    big, small = unique_queue("big"), unique_queue("small")
    with App("fair-queues", settings=Settings(broker_url=test_vhost_url)) as app:
        backlog = app.send_many(
            [Signature(NOOP, options={"queue": big, "ignore_result": True}) for _ in range(10_000)]
        )
        app.flush(timeout=120)
        assert len(backlog) == 10_000
        try:
            with WorkerProcess(test_vhost_url, queues=[big, small], concurrency=2) as worker:
                worker.wait_ready()
                sent = time.time()
                results = [app.send_task(TIMED, args=(0.0,), queue=small) for _ in range(10)]
                starts = [r.get(timeout=30)[0] - sent for r in results]
        finally:
            delete_queues(test_vhost_url, big, f"{big}.dead", small, f"{small}.dead")
    # Served in turn with the 10,000 waiting in the big queue, not after it drained (~8 s).
    assert max(starts) < 1.0, starts


def test_a_prefetch_budget_deepens_for_short_tasks_and_falls_to_one_after_a_long_one(
    test_vhost_url: str, queue: str, client: App
):
    with WorkerProcess(
        test_vhost_url, queues=[queue], concurrency=1, extra_args=["--prefetch-budget", "10ms"]
    ) as worker:
        worker.wait_ready()
        shorts = [client.send_task(NOOP, queue=queue) for _ in range(300)]
        for result in shorts:
            result.get(timeout=60)

        grew = "the prefetch never grew"
        wait_for(lambda: any(p > 1 for p in _prefetches(worker)), timeout_s=10, message=grew)
        assert max(_prefetches(worker)) <= 64
        client.send_task(TIMED, args=(0.3,), queue=queue).get(timeout=30)
        deep = "a long task left the prefetch deep"
        wait_for(lambda: _prefetches(worker)[-1] == 1, timeout_s=10, message=deep)


def test_what_a_child_holds_behind_a_task_that_outlives_the_budget_goes_back_uncounted(
    test_vhost_url: str, queue: str, client: App
):
    # --delivery-limit 0: a hand-back counted as a failed delivery would dead-letter the task. A
    # budget of 100 ms: at 10 ms a no-op that a loaded machine stretches past it counts as long
    # and empties the child's prefetch, and then the long task's child holds nothing to hand back.
    args = ["--prefetch-budget", "100ms", "--delivery-limit", "0"]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2, extra_args=args) as worker:
        worker.wait_ready()
        _warm(worker, client, queue)
        long = client.send_task(TIMED, args=(5.0,), queue=queue)
        sent = time.time()
        shorts = [client.send_task(TIMED, args=(0.01,), queue=queue) for _ in range(100)]
        ends = [r.get(timeout=30)[1] for r in shorts]
        # 100 x 10 ms is 1 s of work for the free child: none waited for the long task's end.
        assert max(ends) - sent < 3.0, max(ends) - sent
        assert not long.ready()
        handed = [e for e in worker.events() if e.get("event") == "tasks_handed_back_behind_long_task"]
        assert handed and sum(int(e["count"]) for e in handed) > 0
        assert long.get(timeout=15)[1] - sent > 4.0
    assert queue_depth(test_vhost_url, f"{queue}.dead") == 0


def test_a_task_that_crashes_child_after_child_takes_no_prefetched_task_down_with_it(
    test_vhost_url: str, queue: str, client: App
):
    args = ["--prefetch-budget", "10ms", "--delivery-limit", "1"]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2, extra_args=args) as worker:
        worker.wait_ready()
        for result in [client.send_task(NOOP, queue=queue) for _ in range(300)]:
            result.get(timeout=60)
        poison = client.send_task(KILL_CHILD, queue=queue)
        innocents = [client.send_task(NOOP, queue=queue) for _ in range(200)]
        for result in innocents:
            result.get(timeout=60)  # each ran: none was dead-lettered beside the poison task
        wait_for(lambda: queue_depth(test_vhost_url, f"{queue}.dead") == 1, timeout_s=30,
                 message="the task that crashes its child was not dead-lettered")  # fmt: skip
        assert not poison.ready() or poison.state == "FAILURE"


def test_redelivered_tasks_come_one_at_a_time_not_each_behind_a_hand_back(
    test_vhost_url: str, queue: str, client: App
):
    # A crash brings many deliveries back at once, each maybe the one that crashed. The first
    # hands back what the child holds; then the child takes one at a time until a task that never
    # failed comes. Paused and handed back before each, 60 of them made about 60 hand-backs of
    # all the rest (quadratic copies) and as many consumers cancelled and made anew.
    args = ["--prefetch-budget", "10ms", "--delivery-limit", "5"]
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1, extra_args=args) as worker:
        worker.wait_ready()
        _warm(worker, client, queue)
        # Counted as one earlier delivery that did not finish, as a crash would leave them.
        suspects = [
            client.send_task(NOOP, queue=queue, headers={"x-clockwork-deliveries": 1}) for _ in range(60)
        ]
        for result in suspects:
            result.get(timeout=60)
        fresh = [client.send_task(NOOP, queue=queue) for _ in range(100)]
        for result in fresh:
            result.get(timeout=60)
        handed = [e for e in worker.events() if e.get("event") == "tasks_handed_back_behind_redelivery"]
        assert len(handed) <= 3, [e["count"] for e in handed]
        prefetches = _prefetches(worker)
        assert prefetches[-1] > 1, prefetches  # deep again once tasks that never failed came
    assert queue_depth(test_vhost_url, f"{queue}.dead") == 0


def _prefetches(worker: WorkerProcess) -> list[int]:
    """The prefetches the worker's children changed to, in order."""
    return [int(e["prefetch"]) for e in worker.events() if e.get("event") == "feed_prefetch_changed"]


def _warm(worker: WorkerProcess, client: App, queue: str) -> None:
    """300 no-op tasks run, then the budget's prefetch has grown at least once."""
    for result in [client.send_task(NOOP, queue=queue) for _ in range(300)]:
        result.get(timeout=60)
    wait_for(lambda: bool(_prefetches(worker)), timeout_s=10, message="the prefetch never grew")
