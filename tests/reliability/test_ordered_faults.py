"""O1: an ordered quorum queue keeps its order through a broker restart (a private node).

Two workers (2 consuming children each) share an ordered quorum queue; 300 tasks are published and
confirmed, and once 100 have run the broker's app is stopped and started again under them. Every
task journals its start and end (tests/support/order_journal.py); after the recovery the journal
must still show one task at a time in publish order, nothing lost, a repeat only as the marked
first task after a failover.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings
from broker_svc.tasks.task import Signature
from tests.infra.private_node import PrivateNode
from tests.reliability.journal import report
from tests.support.order_journal import check_order, read_journal
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess, unique_queue

APP = "tests.integration.ordered_tasks:app"
TASKS = 300
STEP_S = 0.02  # 250 steps, 5 s, are left when the broker is stopped: stop_app takes seconds under load


@pytest.fixture(scope="module")
def node() -> Iterator[PrivateNode]:
    with PrivateNode.started() as broker:
        yield broker


def _ends(journal: Path) -> int:
    return len({line["seq"] for line in read_journal(journal) if line["phase"] == "end"})


def test_an_ordered_quorum_queue_keeps_its_order_through_a_broker_restart(node: PrivateNode, tmp_path: Path):
    queue, journal = unique_queue("ordered-qq"), tmp_path / "restart.jsonl"
    options = ["--ordered-queues", queue, "--quorum-queues", queue]
    settings = Settings(broker_url=node.url, ordered_queues=(queue,), quorum_queues=(queue,))
    with (
        WorkerProcess(node.url, app=APP, queues=[queue], concurrency=2, extra_args=options) as first,
        WorkerProcess(node.url, app=APP, queues=[queue], concurrency=2, extra_args=options) as second,
    ):
        first.wait_ready()
        second.wait_ready()
        with App("ordered-client", settings=settings) as app:
            app.send_many(
                Signature(
                    "ordered.step",
                    args=(seq, str(journal), STEP_S),
                    options={"queue": queue, "ignore_result": True},
                )
                for seq in range(TASKS)
            )
            app.flush(timeout=60)
        wait_for(lambda: _ends(journal) >= 50, timeout_s=60, message="50 tasks not done before the restart")
        node.rabbitmqctl("stop_app")
        down_at = time.monotonic()
        done_at_stop = _ends(journal)
        # On a starved machine stop_app can take seconds, while the queue keeps delivering.
        assert done_at_stop < TASKS, "every task ended before the broker stopped: make the steps longer"
        node.rabbitmqctl("start_app")
        wait_for(lambda: _ends(journal) > done_at_stop, timeout_s=60, message="nothing ran after the restart")
        resumed_s = time.monotonic() - down_at
        wait_for(lambda: _ends(journal) >= TASKS, timeout_s=60, message=f"not all done: {_ends(journal)}")
        redeliveries = first.count("ordered_redelivery") + second.count("ordered_redelivery")
    verdict = check_order(read_journal(journal), expected=TASKS)
    report("O1", None, case="broker stop_app/start_app, quorum ordered queue", tasks=TASKS,
           lost=len(verdict.missing), overlaps=verdict.overlaps, out_of_order=verdict.out_of_order,
           repeats_marked=verdict.repeats_marked, repeats_unmarked=verdict.repeats_unmarked,
           ordered_redelivery_logged=redeliveries, nodes=len(verdict.nodes),
           resumed_s=round(resumed_s, 2))  # fmt: skip
    assert verdict.ok, verdict
