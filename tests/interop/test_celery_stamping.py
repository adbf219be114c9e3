"""Celery's stamping and ``revoke_by_stamped_headers``, from a real Celery 5.7 client and from ours,
against our worker and a Celery worker side by side.

Both workers define the same task names (tests/interop/celery_app.py for Celery's,
tests/integration/stamping_tasks.py for ours). Each test sends the same stamped call to both and
compares what the task saw, or revokes by the same stamps on both and compares the outcome.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery.exceptions import TaskRevokedError as CeleryRevoked

from broker_svc import App, Settings, StampingVisitor, TaskRevokedError
from tests.interop.conftest import celery_node_name, celery_worker
from tests.support.amqp import delete_queues
from tests.support.pidbox import call
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

pytestmark = pytest.mark.interop

TASKS = "tests.integration.stamping_tasks:app"


@dataclass(frozen=True)
class Pair:
    """Our worker and a Celery worker, each on a queue of its own, with the same task names."""

    url: str
    ours: str  # queue
    ours_node: str
    celery: str  # queue
    celery_node: str

    @property
    def queues(self) -> tuple[str, str]:
        return (self.ours, self.celery)

    @property
    def nodes(self) -> list[str]:
        return [self.ours_node, self.celery_node]


@pytest.fixture(scope="module")
def pair(test_vhost_url: str) -> Iterator[Pair]:
    ours, theirs = unique_queue("stamps-ours"), unique_queue("stamps-celery")
    name = f"stamps-{uuid.uuid4().hex[:6]}@test"
    # Two children: a terminated one is replaced while the other keeps consuming.
    worker = WorkerProcess(test_vhost_url, app=TASKS, queues=[ours], name=name, concurrency=2)
    with worker, celery_worker(test_vhost_url, theirs, pool="prefork", concurrency=2):
        worker.wait_ready()
        yield Pair(test_vhost_url, ours, name, theirs, celery_node_name(theirs))
    delete_queues(test_vhost_url, ours, f"{ours}.dead", theirs)


@pytest.fixture
def our_client(test_vhost_url: str) -> Iterator[App]:
    app = App("stamps-client", settings=Settings(broker_url=test_vhost_url))
    yield app
    app.close()


def _value() -> str:
    return uuid.uuid4().hex[:8]  # a stamp value of this test only: revokes stay on the broker


class Tagger:
    """One set of visitor hooks, for Celery's visitor class and ours."""

    def on_signature(self, sig: Any, **headers: Any) -> dict[str, Any]:
        return {"step": sig["task"]}

    def on_chain_start(self, chain: Any, **headers: Any) -> dict[str, Any]:
        return {"flow": "f1"}


# -- stamps reach the task ------------------------------------------------------------------------------


def test_a_celery_clients_stamps_reach_the_task_as_on_a_celery_worker(celery_client, pair: Pair):
    seen = []
    for queue in pair.queues:
        sig = celery_client.signature("stamps.look", queue=queue)
        sig.stamp(tenant="acme", tags=["a", "b"])
        seen.append(sig.apply_async().get(timeout=30))
    ours, theirs = seen
    assert ours == theirs
    assert ours["stamped_headers"] == ["tags", "tenant"]
    assert ours["stamps"] == {"tenant": "acme", "tags": ["a", "b"]}


def test_our_clients_stamps_reach_the_task_as_on_a_celery_worker(our_client: App, pair: Pair):
    seen: list[Any] = []
    for queue in pair.queues:
        sig = our_client.signature("stamps.look", queue=queue)
        sig.stamp(tenant="acme")
        sig.stamp(append_stamps=True, tenant="globex")
        seen.append(sig.apply_async().get(timeout=30))
    assert seen[0] == seen[1]
    assert seen[0]["stamps"] == {"tenant": ["globex", "acme"]}


def test_an_unstamped_task_sees_celerys_empty_stamps(celery_client, pair: Pair):
    ours, theirs = (celery_client.send_task("stamps.look", queue=q).get(timeout=30) for q in pair.queues)
    assert ours == theirs and ours["stamps"] == {}


def test_a_chains_later_steps_keep_the_stamps_as_on_a_celery_worker(
    celery_client, our_client: App, pair: Pair
):
    from celery import chain as celery_chain
    from celery.canvas import StampingVisitor as CeleryVisitor

    class CeleryTagger(Tagger, CeleryVisitor):  # type: ignore[misc]
        pass

    class OurTagger(Tagger, StampingVisitor):
        pass

    seen = []
    for queue in pair.queues:
        # The worker sends the second step, from the stamped signature the first message carried.
        theirs = celery_chain(
            celery_client.signature("stamps.look", queue=queue),
            celery_client.signature("stamps.look", queue=queue),
        )
        theirs.stamp(CeleryTagger(), run="r1")
        seen.append(theirs.apply_async().get(timeout=30))
        ours = our_client.signature("stamps.look", queue=queue) | our_client.signature(
            "stamps.look", queue=queue
        )
        ours.stamp(OurTagger(), run="r1")
        seen.append(ours.apply_async().get(timeout=30))
    assert seen[0] == seen[1] == seen[2] == seen[3], seen
    last = seen[0]
    assert last["stamps"] == {"run": "r1", "flow": "f1", "step": "stamps.look"}
    assert last["parents"][0]["stamps"] == last["stamps"]  # the first step had them too


# -- revoke by stamps -----------------------------------------------------------------------------------


def test_a_task_stamped_with_a_value_celery_revoked_is_revoked_on_both(celery_client, pair: Pair):
    batch = _value()
    replies = celery_client.control.revoke_by_stamped_headers(
        {"batch": batch}, destination=pair.nodes, reply=True, timeout=5
    )
    by_node = {node: answer for reply in replies for node, answer in reply.items()}
    assert (
        by_node[pair.ours_node]
        == by_node[pair.celery_node]
        == {"ok": f"headers {{'batch': '{batch}'}} flagged as revoked, but not terminated"}
    )
    for queue in pair.queues:
        revoked = celery_client.signature("stamps.look", queue=queue)
        revoked.stamp(batch=[batch, "other"])  # a list matches by any of its values
        kept = celery_client.signature("stamps.look", queue=queue)
        kept.stamp(batch="not-" + batch)
        sent, runs = revoked.apply_async(), kept.apply_async()
        with pytest.raises(CeleryRevoked):
            sent.get(timeout=30)
        assert sent.state == "REVOKED"
        assert runs.get(timeout=30)["stamps"] == {"batch": "not-" + batch}
    assert pair.ours_node in celery_client.control.inspect(destination=[pair.ours_node], timeout=5).ping()


def test_our_clients_revoke_by_stamps_revokes_on_both(celery_client, our_client: App, pair: Pair):
    batch = _value()
    replies = our_client.control.revoke_by_stamped_headers(
        {"batch": batch}, destination=pair.nodes, reply=True
    )
    assert replies is not None and len(replies) == 2
    for queue in pair.queues:
        sig = our_client.signature("stamps.look", queue=queue)
        sig.stamp(batch=batch)
        with pytest.raises(TaskRevokedError):
            sig.apply_async().get(timeout=30)
        theirs = celery_client.signature("stamps.look", queue=queue)
        theirs.stamp(batch=batch)
        with pytest.raises(CeleryRevoked):
            theirs.apply_async().get(timeout=30)


def test_terminate_by_stamps_ends_a_running_task_on_both(celery_client, pair: Pair):
    run = _value()
    sent = []
    for queue in pair.queues:
        sig = celery_client.signature("stamps.sleep", (60,), queue=queue)
        sig.stamp(run=run)
        sent.append(sig.apply_async())
    for node, result in zip(pair.nodes, sent, strict=True):
        inspect = celery_client.control.inspect(destination=[node], timeout=5)

        def running(node: str = node, task_id: str = result.id, inspect: Any = inspect) -> bool:
            return any(task["id"] == task_id for task in (inspect.active() or {}).get(node, []))

        wait_for(running, timeout_s=30, message=f"{node} never ran {result.id}")
    replies = celery_client.control.revoke_by_stamped_headers(
        {"run": run}, destination=pair.nodes, terminate=True, reply=True, timeout=5
    )
    by_node = {node: answer for reply in replies for node, answer in reply.items()}
    for node in pair.nodes:
        # Celery's text shows its defaultdict of what matched; ours the plain map.
        text = by_node[node]["ok"]
        assert f"{{'run': {{'{run}'}}}}" in text and text.endswith(" revoked"), by_node
    for result in sent:
        with pytest.raises(CeleryRevoked):
            result.get(timeout=30)  # long before the sleep's 60 s
        assert result.state == "REVOKED"


def test_a_worker_started_after_a_stamped_revoke_honours_it(our_client: App, test_vhost_url: str):
    batch, queue = _value(), unique_queue("stamps-late")
    our_client.control.revoke_by_stamped_headers({"batch": batch})  # no worker of this queue runs yet
    try:
        with WorkerProcess(test_vhost_url, app=TASKS, queues=[queue], concurrency=1) as late:
            late.wait_ready()
            sig = our_client.signature("stamps.look", queue=queue)
            sig.stamp(batch=batch)
            with pytest.raises(TaskRevokedError):
                sig.apply_async().get(timeout=30)
            other = our_client.signature("stamps.look", queue=queue)
            other.stamp(batch="not-" + batch)
            shown: Any = other.apply_async().get(timeout=30)
            assert shown["stamps"] == {"batch": "not-" + batch}
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_a_stamped_revoke_from_celery_holds_on_our_worker_after_a_restart(celery_client, test_vhost_url: str):
    # celery control revoke_by_stamped_headers does not write our log: the worker journals it.
    batch, queue = _value(), unique_queue("stamps-restart")
    name = f"stamps-restart-{uuid.uuid4().hex[:6]}@test"
    try:
        with WorkerProcess(test_vhost_url, app=TASKS, queues=[queue], name=name, concurrency=1) as first:
            first.wait_ready()
            replies = call(
                test_vhost_url, "revoke_by_stamped_headers", arguments={"headers": ["batch=" + batch]},
                destination=[name], expect=1,
            )  # fmt: skip
            assert replies[0][1][name] == {
                "ok": f"headers {{'batch': '{batch}'}} flagged as revoked, but not terminated"
            }
        with WorkerProcess(test_vhost_url, app=TASKS, queues=[queue], concurrency=1) as second:
            second.wait_ready()
            sig = celery_client.signature("stamps.look", queue=queue)
            sig.stamp(batch=batch)
            with pytest.raises(CeleryRevoked):
                sig.apply_async().get(timeout=30)
    finally:
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


@pytest.mark.parametrize("headers", ["batch", 7, ["novalue"], {"batch": {"nested": 1}}])
def test_bad_headers_get_an_error_reply_and_the_worker_keeps_answering(pair: Pair, headers: Any):
    replies = call(
        pair.url, "revoke_by_stamped_headers", arguments={"headers": headers}, destination=[pair.ours_node],
        expect=1,
    )  # fmt: skip
    assert "error" in replies[0][1][pair.ours_node], replies
    pong = call(pair.url, "ping", destination=[pair.ours_node], expect=1)
    assert pong[0][1][pair.ours_node] == {"ok": "pong"}


def test_celery_control_revoke_by_stamped_headers_answers_as_a_celery_worker(pair: Pair):
    batch = _value()
    outputs = []
    for node in pair.nodes:
        command = [
            sys.executable, "-m", "celery", "-b", pair.url, "--no-color", "control",
            "revoke_by_stamped_headers", f"batch={batch}", "-d", node, "--timeout", "5",
        ]  # fmt: skip
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        outputs.append(out.stdout.replace(node, "NODE"))
    assert outputs[0] == outputs[1], outputs
    assert "flagged as revoked" in outputs[0]
