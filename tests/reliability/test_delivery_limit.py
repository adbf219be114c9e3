"""R2: a poison task runs exactly ``delivery_limit + 1`` times, then goes to the dead-letter queue.

The poison either kills the child running it or the whole worker; a supervisor loop here restarts
the worker each time it dies, as systemd or Kubernetes would. Classic and quorum queues both: the
count travels with the message (worker.rules.deliveries), so it survives the restarts.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, AsyncResult, Settings
from broker_svc.topology import task_queue
from tests.reliability.journal import Journal, check, report
from tests.support.amqp import channel, delete_queues, drain, queue_depth
from tests.support.waiting import poll
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.reliability.delivery_tasks:app"
LIMIT = 3  # the default delivery_limit
NORMAL = 100


class Supervisor:
    """Keeps one worker running: starts a fresh one whenever the last one died."""

    def __init__(self, url: str, queue: str, *, extra_args: list[str], env: dict[str, str]) -> None:
        self._url, self._queue, self._extra_args, self._env = url, queue, extra_args, env
        self.restarts = 0
        self.worker = self._start().wait_ready()

    def _start(self) -> WorkerProcess:
        return WorkerProcess(
            self._url,
            app=APP,
            queues=[self._queue],
            # One child at the default prefetch budget: before a redelivered task runs (maybe the
            # poison) the child hands back what it holds, so no innocent task is caught in the
            # crash loop (each would count a delivery).
            concurrency=1,
            extra_args=["--without-mingle", "--statedb", "none", *self._extra_args],
            env=self._env,
        )  # not waited for: a restarted worker may take the poison (and die) before it says ready

    def tend(self) -> None:
        """Restart the worker if it died."""
        if self.worker.proc.poll() is not None:
            self.worker.close()
            self.restarts += 1
            self.worker = self._start()

    def close(self) -> None:
        self.worker.close()


def _send_among_innocents(
    client: App, journal: Journal, queue: str, poison: str
) -> tuple[list[AsyncResult], AsyncResult]:
    """``NORMAL`` no-op tasks with the poison in their middle, confirmed and journalled."""
    normal = [client.send_task("journal.noop", queue=queue, ignore_result=True) for _ in range(NORMAL // 2)]
    bad = client.send_task(poison, queue=queue)
    normal += [client.send_task("journal.noop", queue=queue, ignore_result=True) for _ in range(NORMAL // 2)]
    client.flush(timeout=30)
    for result in [*normal, bad]:
        journal.published(result.id, confirmed=True)
    return normal, bad


@pytest.fixture
def r2_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("r2")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
@pytest.mark.parametrize("poison", ["journal.kill_child", "journal.kill_worker"])
def test_a_poison_task_runs_limit_plus_one_times_then_is_dead_lettered(
    test_vhost_url: str, r2_queue: str, tmp_path: Path, queue_type: str, poison: str
):
    queue = r2_queue
    journal = Journal(tmp_path / "journal")
    quorum = (queue,) if queue_type == "quorum" else ()
    extra = ["--quorum-queues", queue] if quorum else []
    supervisor = Supervisor(test_vhost_url, queue, extra_args=extra, env=journal.env)
    client = App("r2", settings=Settings(broker_url=test_vhost_url, quorum_queues=quorum))
    try:
        with channel(test_vhost_url) as ch:  # both sides declared it alike: no 406 on the way
            declared = ch.queue_declare(queue, passive=True)
            assert declared.method.queue == queue
        assert task_queue(queue, queue_type=client.settings.queue_type(queue)).arguments == (
            {"x-queue-type": "quorum"} if quorum else {}
        )
        started = time.monotonic()
        normal, bad = _send_among_innocents(client, journal, queue, poison)
        dead: list = []

        def dead_lettered() -> bool:
            supervisor.tend()
            dead.extend(drain(test_vhost_url, f"{queue}.dead"))
            return bool(dead)

        assert poll(dead_lettered, timeout_s=90, interval_s=0.1), (
            f"poison not dead-lettered; runs so far: "
            f"{sum(1 for e in journal.executions() if e.task_id == bad.id)}, restarts {supervisor.restarts}"
        )
        to_dlq_s = time.monotonic() - started
        journal.wait_executed([r.id for r in normal], timeout_s=60)
        with pytest.raises(Exception) as info:
            bad.get(timeout=30)
        runs = [e for e in journal.executions() if e.task_id == bad.id]
        verdict = check(journal)
        report(
            "R2",
            verdict,
            queue_type=queue_type,
            poison=poison,
            poison_executions=len(runs),
            delivery_limit=LIMIT,
            worker_restarts=supervisor.restarts,
            seconds_until_dlq=round(to_dlq_s, 2),
            dlq_reason=dead[0].headers.get("x-clockwork-reason"),
        )
        assert len(runs) == LIMIT + 1
        assert [e.delivery_count for e in runs] == list(range(LIMIT + 1))  # counted, and marked
        assert all(e.marked for e in runs[1:])
        assert len(dead) == 1 and dead[0].headers["id"] == bad.id
        assert dead[0].headers["x-clockwork-reason"] == "delivery_limit"
        assert getattr(info.value, "exc_type", "") == "WorkerLostError"
        assert verdict.lost == 0 and verdict.unexpected == 0 and verdict.unmarked_duplicates == 0
        # Beside the poison's, only repeats of a hand-back cut short: a child handing back what it
        # holds (a copy of each confirmed, the originals not acked yet) when the poison killed it
        # leaves both, and the copy says it was sent again (redelivered, no earlier delivery).
        executions = journal.executions()
        repeated = Counter(e.task_id for e in executions if e.task_id != bad.id)
        for task_id in [t for t, n in repeated.items() if n > 1]:
            runs_of = [e for e in executions if e.task_id == task_id]
            copies = [e for e in runs_of if e.redelivered and not e.delivery_count]
            assert len(runs_of) == 2 and len(copies) == 1, runs_of
        assert supervisor.restarts == (LIMIT + 1 if poison == "journal.kill_worker" else 0)
    finally:
        client.close(timeout=10)
        supervisor.close()


def test_under_threads_a_poison_on_a_classic_queue_runs_limit_plus_one_times_and_loses_nothing(
    test_vhost_url: str, r2_queue: str, tmp_path: Path
):
    """R2 with ``--threads 4``: a classic queue's count travels in a copy confirmed before the
    original is acked. A sibling thread that took the copy and crashed the child before that ack
    would bring the original back beside it, the poison queued twice and run more often; it waits
    for the ack (``worker/consume/settle.py:CopiesInFlight``). Siblings that share the child with the
    poison run again, marked (the guide's "Threads for I/O-bound tasks")."""
    queue = r2_queue
    journal = Journal(tmp_path / "journal")
    supervisor = Supervisor(test_vhost_url, queue, extra_args=["--threads", "4"], env=journal.env)
    client = App("r2-threads", settings=Settings(broker_url=test_vhost_url))
    try:
        normal, bad = _send_among_innocents(client, journal, queue, "journal.kill_child")
        dead: list = []

        def poison_dead() -> bool:
            supervisor.tend()
            dead.extend(drain(test_vhost_url, f"{queue}.dead"))
            return any(message.headers.get("id") == bad.id for message in dead)

        assert poll(poison_dead, timeout_s=90, interval_s=0.1), "the poison was not dead-lettered"
        survivors = {m.headers.get("id") for m in dead} - {bad.id}  # siblings dead-lettered beside it
        journal.wait_executed([r.id for r in normal if r.id not in survivors], timeout_s=60)
        runs = [e for e in journal.executions() if e.task_id == bad.id]
        # What was dead-lettered beside the poison is in the dead-letter queue, not lost.
        verdict = check(journal, expected=[r.id for r in [*normal, bad] if r.id not in survivors])
        assert len(runs) == LIMIT + 1, [e.delivery_count for e in runs]
        assert sorted(e.delivery_count for e in runs) == list(range(LIMIT + 1))
        assert verdict.lost == 0 and verdict.unexpected == 0 and verdict.unmarked_duplicates == 0, verdict
        assert supervisor.restarts == 0
    finally:
        client.close(timeout=10)
        supervisor.close()


# -- R26: a task id delivered twice --------------------------------------------------------------

DUPLICATED_IDS = 30


@pytest.mark.parametrize("dedupe", [False, True], ids=["at_least_once", "dedupe"])
def test_the_same_task_id_delivered_twice_runs_twice_by_default_and_once_with_dedupe(
    test_vhost_url: str, r2_queue: str, tmp_path: Path, dedupe: bool
):
    queue = r2_queue
    journal = Journal(tmp_path / "journal")
    extra = ["--without-mingle", "--statedb", "none"] + (["--dedupe-window", "60"] if dedupe else [])
    client = App("r26", settings=Settings(broker_url=test_vhost_url))
    # Two children and a prefetch of four: the copies of one id may arrive while the first runs.
    worker = WorkerProcess(
        test_vhost_url,
        app=APP,
        queues=[queue],
        concurrency=2,
        extra_args=[*extra, "--prefetch-multiplier", "2"],
        env=journal.env,
    )
    try:
        worker.wait_ready()
        ids = [f"r26-{uuid.uuid4().hex[:8]}" for _ in range(DUPLICATED_IDS)]
        # As a publisher that lost a confirm and sent again: the same message, twice.
        for task_id in ids:
            client.send_task("journal.sleep", (0.05,), queue=queue, task_id=task_id, ignore_result=True)
        for task_id in ids:
            client.send_task("journal.sleep", (0.05,), queue=queue, task_id=task_id, ignore_result=True)
        client.flush(timeout=30)
        for task_id in ids:
            journal.published(task_id, confirmed=True)
        journal.wait_executed(ids, timeout_s=60)
        expected_runs = len(ids) if dedupe else 2 * len(ids)
        poll(lambda: len(journal.executions()) >= expected_runs, timeout_s=30)
        # Settled: every copy was either run or skipped, and acked.
        assert poll(lambda: queue_depth(test_vhost_url, queue) == 0, timeout_s=30)
        skipped = poll(
            lambda: worker.count("task_duplicate_skipped") >= len(ids), timeout_s=10 if dedupe else 0
        )
        runs = Counter(e.task_id for e in journal.executions())
        verdict = check(journal)
        report(
            "R26",
            verdict,
            mode="dedupe" if dedupe else "at_least_once",
            deliveries_per_id=2,
            executions_per_id=sorted(set(runs.values())),
            duplicates_skipped=worker.count("task_duplicate_skipped"),
        )
        assert verdict.lost == 0
        if dedupe:
            assert set(runs.values()) == {1} and skipped
        else:
            assert set(runs.values()) == {2} and worker.count("task_duplicate_skipped") == 0
    finally:
        client.close(timeout=10)
        worker.close()


def test_a_quorum_queue_is_declared_as_celery_declares_it_so_mixed_fleets_share_it(
    test_vhost_url: str, r2_queue: str, tmp_path: Path
):
    celery = pytest.importorskip("celery")
    queue = r2_queue
    journal = Journal(tmp_path / "journal")
    # A Celery client declares the queue first, as quorum (task_default_queue_type covers only the
    # default queue; task_create_missing_queue_type the queues named at send time).
    capp = celery.Celery("mixed", broker=test_vhost_url)
    capp.conf.update(
        task_default_queue_type="quorum", task_create_missing_queue_type="quorum", task_serializer="json"
    )
    first = capp.send_task("journal.noop", queue=queue)
    capp.close()
    # Our worker and our client declare it again: any difference would be a 406 here.
    client = App("mixed", settings=Settings(broker_url=test_vhost_url, quorum_queues=(queue,)))
    with WorkerProcess(
        test_vhost_url,
        app=APP,
        queues=[queue],
        concurrency=1,
        extra_args=["--without-mingle", "--statedb", "none", "--quorum-queues", queue],
        env=journal.env,
    ) as worker:
        worker.wait_ready()
        second = client.send_task("journal.noop", queue=queue)
        second.get(timeout=30)
        journal.wait_executed([first.id, second.id], timeout_s=30)
        assert worker.proc.poll() is None
    client.close(timeout=10)
    with channel(test_vhost_url) as ch:
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "quorum"}, passive=False)
