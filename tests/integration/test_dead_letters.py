"""``ctl dead`` and ``app.control.dead_letters`` on real dead letters made by a real worker: list,
show, requeue (the tasks then run, once each, even when a requeue is killed midway) and purge."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest

from broker_svc import App, Settings
from broker_svc.errors import DeadLetterNotFound, DeadQueueBusy
from broker_svc.topology import dead_letter_lock_queue
from control.blocking.dead_letters import DeadLetters
from tests.support.amqp import channel, delete_queues, publish_raw, queue_depth, queue_exists
from tests.support.metrics import free_port, scrape
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

T = "tests.integration.dead_letter_tasks."
# Each test has a queue of its own, all consumed by the module's one worker.
QUEUES = ("ctl", "api", "kill", "busy")


@pytest.fixture(scope="module")
def queues() -> dict[str, str]:
    return {name: unique_queue(f"dl-{name}") for name in QUEUES}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def dl_worker(test_vhost_url: str, queues: dict[str, str], metrics_port: int) -> Iterator[WorkerProcess]:
    args = ["--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1"]
    app = "tests.integration.dead_letter_tasks:app"
    with WorkerProcess(
        test_vhost_url, app=app, queues=list(queues.values()), concurrency=1, extra_args=args
    ) as proc:
        yield proc.wait_ready()
    delete_queues(test_vhost_url, *queues.values(), *(f"{q}.dead" for q in queues.values()))


@pytest.fixture(scope="module")
def client(test_vhost_url: str) -> Iterator[App]:
    app = App("dl-client", settings=Settings(broker_url=test_vhost_url))
    yield app
    app.close(timeout=10)


def ctl(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    return subprocess.run(
        [sys.executable, "-m", "control.cli", "-b", url, "dead", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def wait_dead(url: str, queue: str, count: int) -> None:
    wait_for(
        lambda: queue_depth(url, f"{queue}.dead") >= count,
        timeout_s=60,
        message=f"fewer than {count} dead letters in {queue}.dead",
    )


def tags_in(path: Path) -> Counter[str]:
    return Counter(path.read_text().split()) if path.exists() else Counter()


def wait_tags(path: Path, expected: set[str]) -> None:
    wait_for(
        lambda: expected <= set(tags_in(path)), timeout_s=60, message=f"not all of {sorted(expected)} ran"
    )


def metric(port: int, name: str, **labels: str) -> float:
    samples = scrape(port)
    return float(sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)))


def test_ctl_lists_shows_requeues_and_purges_every_kind_of_dead_letter(
    test_vhost_url: str, queues: dict[str, str], dl_worker: WorkerProcess, client: App, tmp_path: Path,
    metrics_port: int,
):  # fmt: skip
    url, queue = test_vhost_url, queues["ctl"]
    flag, out = tmp_path / "flag", tmp_path / "ran.txt"
    rejected = client.send_task(T + "reject_unless", (str(flag), str(out), "rejected"), queue=queue)
    retried = client.send_task(T + "retry_unless", (str(flag), str(out), "retried"), queue=queue)
    # A task this worker's app does not have, and a body it must never decode.
    unknown = client.send_task("tests.integration.e2e_tasks.record", (str(out), "unknown"), queue=queue)
    publish_raw(url, queue, b"!!python/object:os.system {}", headers={"task": T + "record", "id": "yaml-1"},
                content_type="application/x-yaml")  # fmt: skip
    wait_dead(url, queue, 4)

    listed = ctl(url, "list", queue, "--json")
    assert listed.returncode == 0, output(listed)
    letters = {letter["id"]: letter for letter in json.loads(listed.stdout)}
    assert {k: v["reason"] for k, v in letters.items()} == {
        rejected.id: "rejected", retried.id: "max_retries_exceeded", unknown.id: "NotRegistered",
        "yaml-1": "ContentDisallowed",
    }  # fmt: skip
    assert {v["queue"] for v in letters.values()} == {queue}
    assert letters[rejected.id]["task"] == T + "reject_unless" and letters[rejected.id]["dead_at"]
    # Reading is not taking: all four are still there, in the same order.
    again = ctl(url, "list", f"{queue}.dead", "--json")
    assert [letter["id"] for letter in json.loads(again.stdout)] == list(letters)
    assert queue_depth(url, f"{queue}.dead") == 4
    table = ctl(url, "list", queue)
    assert table.returncode == 0 and "REASON" in table.stdout and "4 dead letters" in table.stdout, output(
        table
    )
    assert rejected.id in table.stdout and "NotRegistered" in table.stdout

    shown = ctl(url, "show", rejected.id, "--json")
    assert shown.returncode == 0, output(shown)
    [full] = json.loads(shown.stdout)
    assert full["body"]["decoded"][0] == [str(flag), str(out), "rejected"]
    assert full["headers"]["x-clockwork-reason"] == "rejected" and full["properties"]["content_type"]
    text = ctl(url, "show", "yaml-1", "--queue", queue)
    assert text.returncode == 0, output(text)
    assert "application/x-yaml" in text.stdout and "not decoded" in text.stdout
    assert "b'!!python/object:os.system {}'" in text.stdout  # shown as bytes, never loaded
    missing = ctl(url, "show", "no-such-id", "--queue", queue)
    assert missing.returncode == 1 and "no dead letter with id no-such-id" in missing.stderr, output(missing)

    # Fixed: the flag is set. Unknown ids requeue nothing; then two go back to their queue and run.
    flag.touch()
    refused = ctl(url, "requeue", rejected.id, "no-such-id", "--queue", queue)
    assert refused.returncode == 1 and "no-such-id" in refused.stderr, output(refused)
    assert queue_depth(url, f"{queue}.dead") == 4
    requeued = ctl(url, "requeue", rejected.id, retried.id, "--queue", queue)
    assert requeued.returncode == 0 and "2 requeued" in requeued.stdout, output(requeued)
    wait_tags(out, {"rejected", "retried"})
    # NotRegistered here: sent to a queue whose worker knows the task.
    other = unique_queue("dl-e2e")
    with WorkerProcess(url, queues=[other], concurrency=1) as e2e:
        e2e.wait_ready()
        moved = ctl(url, "requeue", unknown.id, "--queue", queue, "--to", other, "--json")
        assert moved.returncode == 0, output(moved)
        assert json.loads(moved.stdout)["requeued"][0]["to"] == other
        wait_tags(out, {"unknown"})
    delete_queues(url, other, f"{other}.dead")
    assert tags_in(out) == Counter({"rejected": 1, "retried": 1, "unknown": 1})
    # The worker counts each requeued task once, where it ended.
    wait_for(
        lambda: metric(metrics_port, "clockwork_requeued_tasks_total", queue_name=queue, outcome="done") == 2,
        timeout_s=15,
        message="clockwork_requeued_tasks_total",
    )

    refuse = ctl(url, "purge", queue)
    assert refuse.returncode == 2 and "--yes" in refuse.stderr, output(refuse)
    assert queue_depth(url, f"{queue}.dead") == 1
    purged = ctl(url, "purge", queue, "--yes", "--json")
    assert purged.returncode == 0 and json.loads(purged.stdout) == {f"{queue}.dead": 1}, output(purged)
    assert json.loads(ctl(url, "list", queue, "--json").stdout) == []


def test_the_python_api_lists_shows_requeues_and_purges(
    test_vhost_url: str, queues: dict[str, str], dl_worker: WorkerProcess, client: App, tmp_path: Path,
    metrics_port: int,
):  # fmt: skip
    url, queue = test_vhost_url, queues["api"]
    flag, out = tmp_path / "flag", tmp_path / "ran.txt"
    sent = [
        client.send_task(T + "reject_unless", (str(flag), str(out), f"t{i}"), queue=queue) for i in range(3)
    ]
    wait_dead(url, queue, 3)
    dead = client.control.dead_letters()
    # Without a queue: the dead queues of what the live workers consume, this one among them.
    everywhere = dead.list()
    assert {r.id for r in sent} <= {letter.task_id for letter in everywhere}
    assert f"{queue}.dead" in dead.dead_queues()
    letters = dead.list(queue)
    assert [letter.task_id for letter in letters] == [r.id for r in sent]
    assert [letter.reason for letter in letters] == ["rejected"] * 3 and letters[0].requeued == 0
    [shown] = dead.show(sent[0].id, queue=queue)
    assert shown.task == T + "reject_unless" and shown.queue == queue and shown.error
    with pytest.raises(DeadLetterNotFound) as info:
        dead.show("no-such-id", queue=queue)
    assert info.value.ids == ["no-such-id"]

    # Requeued while still broken: back in the dead queue, and it says it was requeued once.
    result = dead.requeue(sent[0].id, queue=queue)
    assert [(item.letter.task_id, item.queue, item.earlier) for item in result.requeued] == [
        (sent[0].id, queue, False)
    ]
    wait_for(
        lambda: any(letter.requeued == 1 for letter in dead.list(queue)),
        timeout_s=30, message="the requeued task was not dead-lettered again",
    )  # fmt: skip
    again = next(letter for letter in dead.list(queue) if letter.requeued)
    assert again.task_id == sent[0].id and again.headers["x-clockwork-requeued"]["reason"] == "rejected"
    name = "clockwork_requeued_tasks_total"
    wait_for(
        lambda: metric(metrics_port, name, queue_name=queue, outcome="dead_lettered") == 1,
        timeout_s=15, message=f"{name}{{outcome=dead_lettered}}",
    )  # fmt: skip
    # Fixed: all of them go back and run once each; the dead queue is left empty.
    flag.touch()
    everything = dead.requeue_all(queue)
    assert sorted(str(item.letter.task_id) for item in everything.requeued) == sorted(r.id for r in sent)
    wait_tags(out, {"t0", "t1", "t2"})
    assert tags_in(out) == Counter({"t0": 1, "t1": 1, "t2": 1})
    assert dead.list(queue) == [] and queue_depth(url, f"{queue}.dead") == 0
    assert dead.purge(queue) == {f"{queue}.dead": 0}


# The requeue in a process of its own, killed after its K-th copy was confirmed and before that
# dead letter was acked: the window the markers are for.
KILLED_REQUEUE = textwrap.dedent(
    """
    import os, signal, sys
    from broker_svc import Settings
    from control.blocking.dead_letters import DeadLetters

    url, queue, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    confirmed = 0

    def confirmed_one(letter, to):
        global confirmed
        confirmed += 1
        if confirmed == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    DeadLetters(Settings(broker_url=url)).requeue_all(queue, on_confirmed=confirmed_one)
    """
)


def test_a_requeue_killed_between_confirm_and_ack_loses_and_doubles_nothing(
    test_vhost_url: str, queues: dict[str, str], dl_worker: WorkerProcess, client: App, tmp_path: Path
):
    url, queue, count, kill_at = test_vhost_url, queues["kill"], 30, 12
    flag, out = tmp_path / "flag", tmp_path / "ran.txt"
    ids = [
        client.send_task(T + "reject_unless", (str(flag), str(out), f"k{i}"), queue=queue).id
        for i in range(count)
    ]
    wait_dead(url, queue, count)
    # The dead queue's order, which the requeue follows: two children dead-letter side by side, so
    # it need not be the order the tasks were sent in.
    order = [letter.task_id for letter in DeadLetters(Settings(broker_url=url)).list(queue)]
    assert Counter(order) == Counter(ids)
    flag.touch()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_REQUEUE, url, queue, str(kill_at)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, output(killed)
    # Left behind: the 11 acked dead letters' markers, and the 12th dead letter with its marker
    # (its copy is out: it runs), and the 18 it never reached.
    assert queue_depth(url, f"{queue}.dead") == (count - kill_at + 1) + kill_at

    result = DeadLetters(Settings(broker_url=url)).requeue_all(queue)
    earlier = [item for item in result.requeued if item.earlier]
    assert [item.letter.task_id for item in earlier] == [order[kill_at - 1]]
    assert len(result.requeued) - len(earlier) == count - kill_at
    assert result.markers_cleared == kill_at - 1
    assert queue_depth(url, f"{queue}.dead") == 0
    # Everything requeued is in the queue before this task: once it ran, all of them did.
    client.send_task(T + "record", (str(out), "sentinel"), queue=queue).get(timeout=60)
    ran = tags_in(out)
    assert ran == Counter({f"k{i}": 1 for i in range(count)} | {"sentinel": 1}), ran


def test_a_second_caller_waits_for_the_first_then_says_the_queue_is_busy(
    test_vhost_url: str, queues: dict[str, str], dl_worker: WorkerProcess, client: App, tmp_path: Path
):
    url, queue = test_vhost_url, queues["busy"]
    client.send_task(T + "reject_unless", (str(tmp_path / "flag"), str(tmp_path / "out"), "b"), queue=queue)
    wait_dead(url, queue, 1)
    lock = dead_letter_lock_queue(queue)
    with channel(url) as held:  # another caller holds the lock
        held.queue_declare(lock.name, **lock.declare_options())
        busy = ctl(url, "list", queue, "--timeout", "0.3")
        assert busy.returncode == 1 and "another caller" in busy.stderr, output(busy)
        with pytest.raises(DeadQueueBusy):
            DeadLetters(Settings(broker_url=url), lock_wait_s=0.3).purge(queue)
    # Its connection is gone, and the lock with it.
    listed = ctl(url, "list", queue, "--json")
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 1, output(listed)


def test_usage_errors_change_nothing(test_vhost_url: str):
    for args in (("requeue",), ("requeue", "x", "--all"), ("purge",), ("list", "--limit", "0")):
        proc = ctl(test_vhost_url, *args)
        assert proc.returncode == 2, output(proc)
    unknown_queue = f"nowhere-{uuid.uuid4().hex[:8]}"
    proc = ctl(test_vhost_url, "requeue", "--all", "--queue", unknown_queue)
    assert proc.returncode == 0 and "nothing to requeue" in proc.stdout, output(proc)
    assert not queue_exists(test_vhost_url, f"{unknown_queue}.dead")  # nothing declared on the way


def test_a_call_right_after_another_sees_every_dead_letter_it_put_back_or_held_when_killed(
    test_vhost_url: str,
):
    # The first call puts its 2,000 back before it returns (a nack would not): the next reads all.
    url, queue, count = test_vhost_url, unique_queue("dl-back"), 2000
    with channel(url) as ch:
        ch.queue_declare(queue, durable=True)
        ch.queue_declare(f"{queue}.dead", durable=True)
        ch.confirm_delivery()
        for i in range(count):
            headers = {
                "id": f"id-{i}",
                "task": "t",
                "x-clockwork-reason": "rejected",
                "x-clockwork-dead-at": str(i),
            }
            ch.basic_publish("", f"{queue}.dead", b"[[], {}, {}]", pika.BasicProperties(headers=headers))
    try:
        dead = DeadLetters(Settings(broker_url=url))
        assert [letter.task_id for letter in dead.list(queue)] == [f"id-{i}" for i in range(count)]
        assert dead.show(f"id-{count - 1}", queue=queue)[0].reason == "rejected"
        # Killed holding all 2,000 (after its first copy's confirm): the broker has them back
        # before it lets go of the lock, so the next call sees that copy's marker with its letter.
        command = [sys.executable, "-c", KILLED_REQUEUE, url, queue, "1"]
        killed = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert killed.returncode == -signal.SIGKILL, output(killed)
        assert [letter.task_id for letter in dead.list(queue)] == [f"id-{i}" for i in range(1, count)]
        assert queue_depth(url, queue) == 1 and queue_depth(url, f"{queue}.dead") == count - 1
    finally:
        delete_queues(url, queue, f"{queue}.dead")
