"""The ``ctl`` console script, run as a real subprocess against real workers."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pika
import pytest

from broker_svc import App, Settings
from broker_svc.connection.pika_internals import underlying_channel
from broker_svc.topology import EVENT_EXCHANGE, LEGACY_NAMESPACE, revocation_log
from control import ControlClient
from control.cli.main import build_parser
from control.protocol.request import MARKER_HEADER
from control.protocol.revoke_log import RevokeEntry
from tests.support.amqp import channel, delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess

CTL = str(Path(sys.executable).parent / "ctl")
HEARTBEAT_S = 2.0  # the workers' heartbeat interval (worker/events.py)


def start_workers(url: str, count: int, stack: ExitStack) -> list[WorkerProcess]:
    procs = [
        stack.enter_context(WorkerProcess(url, queues=[f"q-{uuid.uuid4().hex[:8]}"], concurrency=1))
        for _ in range(count)
    ]
    for proc in procs:
        proc.wait_ready()
    return procs


@pytest.fixture
def node(vhost_url: str) -> Iterator[WorkerProcess]:
    with ExitStack() as stack:
        [proc] = start_workers(vhost_url, 1, stack)
        yield proc


@pytest.fixture
def three(vhost_url: str) -> Iterator[list[WorkerProcess]]:
    with ExitStack() as stack:
        procs = start_workers(vhost_url, 3, stack)
        wait_members(vhost_url, {p.name for p in procs})
        yield procs


def wait_members(url: str, names: set[str]) -> None:
    """Wait until the members stream shows ``names`` alive (their heartbeats are in it)."""
    with ControlClient(Settings(broker_url=url)) as client:

        def known() -> bool:
            client.broadcast("ping", destination=sorted(names), reply=True, timeout_s=1.0)
            return names <= client.membership.alive(time.time())

        wait_for(known, timeout_s=4 * HEARTBEAT_S + 5, message=f"heartbeats of {sorted(names)}")


def ctl(*args: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    started = time.monotonic()
    proc = subprocess.run([CTL, *args], capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    return proc, time.monotonic() - started


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


# -- membership: early return, and a dead worker ---------------------------------------------------------


def test_inspect_ping_returns_as_soon_as_all_three_live_workers_answered(vhost_url: str, three):
    proc, elapsed = ctl("inspect", "ping", "-b", vhost_url, "--json", "--timeout", "5")
    assert proc.returncode == 0, output(proc)
    assert json.loads(proc.stdout) == {w.name: {"ok": "pong"} for w in three}
    assert elapsed < 2.5, f"took {elapsed:.2f} s: membership did not end the wait"


def test_a_killed_worker_is_reported_missing_within_two_heartbeats_plus_the_timeout(vhost_url: str, three):
    dead, *alive = three
    dead.kill()
    proc, elapsed = ctl("inspect", "ping", "-b", vhost_url, "--json", "--timeout", "5")
    assert proc.returncode == 1, output(proc)
    assert set(json.loads(proc.stdout)) == {w.name for w in alive}
    assert dead.name in proc.stderr and "no reply" in proc.stderr
    assert elapsed < 2 * HEARTBEAT_S + 5


# -- options, destinations and exit codes ------------------------------------------------------------------


def test_options_go_before_or_after_the_subcommand(vhost_url: str, node: WorkerProcess):
    for args in (
        ("-b", vhost_url, "--json", "--timeout", "5", "-d", node.name, "inspect", "ping"),
        ("inspect", "ping", "-b", vhost_url, "--json", "--timeout", "5", "-d", node.name),
        ("--json", "inspect", "-b", vhost_url, "ping", "--destination", node.name),
    ):
        proc, elapsed = ctl(*args)
        assert proc.returncode == 0, output(proc)
        assert json.loads(proc.stdout) == {node.name: {"ok": "pong"}}
        assert elapsed < 4


def test_registered_as_a_table_names_the_workers_tasks(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl("-b", vhost_url, "inspect", "registered", "-d", node.name, "--timeout", "5")
    assert proc.returncode == 0, output(proc)
    assert proc.stdout.startswith(node.name)
    assert "- tests.integration.e2e_tasks.add" in proc.stdout


def test_an_error_reply_exits_1_and_names_the_node(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl(
        "-b", vhost_url, "-d", node.name, "--timeout", "5", "control", "rate-limit", "no.such.task", "1/s"
    )
    assert proc.returncode == 1, output(proc)
    assert "unknown task" in proc.stdout
    assert proc.stderr == f"ctl: the command failed on 1 node: {node.name}\n"


def test_a_destination_nobody_answers_for_exits_69(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl("-b", vhost_url, "inspect", "ping", "-d", "nobody@nowhere", "--timeout", "0.5")
    assert proc.returncode == 69, output(proc)
    assert "No nodes replied within time constraint." in proc.stderr


def test_some_named_nodes_missing_exits_1_and_names_them(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl(
        "-b", vhost_url, "--json", "inspect", "clock", "-d", f"{node.name},nobody@nowhere", "--timeout", "1"
    )
    assert proc.returncode == 1, output(proc)
    assert list(json.loads(proc.stdout)) == [node.name]
    assert "nobody@nowhere" in proc.stderr and node.name not in proc.stderr


def test_an_unknown_inspect_command_is_a_usage_error():
    proc, _ = ctl("inspect", "no-such-thing")
    assert proc.returncode == 2, output(proc)
    assert "invalid choice" in proc.stderr


@pytest.mark.parametrize(
    ("args", "error", "usage"),
    [
        (
            ["rate-limit"],
            "rate-limit: missing TASK_NAME, RATE_LIMIT",
            "ctl control rate-limit TASK_NAME RATE_LIMIT",
        ),
        (
            ["rate-limit", "proj.add"],
            "rate-limit: missing RATE_LIMIT",
            "ctl control rate-limit TASK_NAME RATE_LIMIT",
        ),
        (["add-consumer"], "add-consumer: missing QUEUE", "ctl control add-consumer QUEUE [EXCHANGE]"),
        (
            ["time-limit", "proj.add", "soon"],
            "time-limit: SOFT: 'soon' is not a valid int or float",
            "ctl control time-limit TASK_NAME [SOFT] [HARD]",
        ),
        (
            ["pool-grow", "1", "2"],
            "pool-grow takes at most 1 argument(s), got 2",
            "ctl control pool-grow [N]",
        ),
    ],
)
def test_control_arguments_the_command_refuses_are_a_usage_error_before_anything_is_sent(
    args: list[str], error: str, usage: str
):
    # The broker is unreachable: had ctl tried to send, it would say so and exit 1.
    proc, _ = ctl("-b", "amqp://guest:guest@127.0.0.1:1//", "control", *args)
    assert proc.returncode == 2, output(proc)
    said, told = proc.stderr.splitlines()
    assert said == f"ctl: error: {error}" and told.startswith(f"usage: {usage}"), output(proc)


def test_an_unreachable_broker_is_one_clear_line_without_the_password():
    proc, _ = ctl("-b", "amqp://guest:s3cret@127.0.0.1:1//", "inspect", "ping")
    assert proc.returncode == 1, output(proc)
    assert proc.stderr.startswith("ctl: cannot reach the broker") and proc.stderr.count("\n") == 1
    assert "s3cret" not in proc.stderr + proc.stdout


def test_status_lists_the_nodes_like_celery_status(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl("status", "-b", vhost_url, "-d", node.name, "--timeout", "5")
    assert proc.returncode == 0, output(proc)
    assert proc.stdout == f"{node.name}: OK\n\n1 node online.\n"


def test_destinations_are_comma_separated_or_repeated():
    args = build_parser().parse_args(["-d", "a@h,b@h", "inspect", "ping", "-d", "c@h", "-d", "d@h"])
    assert args.destination == ["c@h", "d@h"]  # a later position replaces an earlier one
    args = build_parser().parse_args(["inspect", "query-task", "id1", "id2", "--json"])
    assert args.ids == ["id1", "id2"] and args.json and args.timeout == 1.0


# -- revoke ------------------------------------------------------------------------------------------------


def read_log_entries(url: str, count: int) -> list[RevokeEntry]:
    spec = revocation_log(LEGACY_NAMESPACE)
    entries: list[RevokeEntry] = []
    with channel(url) as ch:
        ch.queue_declare(spec.name, durable=True, arguments=spec.arguments)
        ch.basic_qos(prefetch_count=100)

        def on_message(_ch: Any, method: Any, props: Any, body: bytes) -> None:
            _ch.basic_ack(method.delivery_tag)
            if MARKER_HEADER not in (props.headers or {}):
                entries.append(RevokeEntry.decode(body))

        ch.basic_consume(spec.name, on_message, arguments={"x-stream-offset": "first"})
        wait_for(
            lambda: ch.connection.process_data_events(time_limit=0.05) or len(entries) >= count,
            timeout_s=10,
            message="revocation log entries",
        )
        impl = underlying_channel(ch)  # see test_control_client.read_revocation_log: streams refuse rejects
        assert impl is not None
        impl.close()
        wait_for(lambda: ch.connection.process_data_events(time_limit=0.05) or ch.is_closed, timeout_s=5,
                 message="stream channel closed")  # fmt: skip
    return entries


def test_revoke_with_no_worker_is_logged_durably_and_exits_0(vhost_url: str):
    proc, _ = ctl("-b", vhost_url, "revoke", "dead-1", "dead-2", "--terminate", "--signal", "SIGKILL")
    assert proc.returncode == 0, output(proc)
    assert "revoke logged; no worker answered" in proc.stderr
    [entry] = read_log_entries(vhost_url, 1)
    assert entry.task_ids == ("dead-1", "dead-2") and entry.terminate and entry.signal == "SIGKILL"


def test_revoke_with_a_worker_shows_its_reply(vhost_url: str, node: WorkerProcess):
    proc, _ = ctl("-b", vhost_url, "--json", "revoke", "some-task", "-d", node.name, "--timeout", "5")
    assert proc.returncode == 0, output(proc)
    assert list(json.loads(proc.stdout)) == [node.name]


def test_inspect_active_shows_a_running_tasks_args_and_kwargs(vhost_url: str, node: WorkerProcess):
    with (
        App("ctl-active", settings=Settings(broker_url=vhost_url)) as app,
        ControlClient(Settings(broker_url=vhost_url)) as client,
    ):
        result = app.send_task(
            "tests.integration.e2e_tasks.sleep_s", (3.0,), {"tag": "hello"}, queue=node.queues[0]
        )
        wait_for(
            lambda: any(
                t["id"] == result.id for t in client.inspect("active", timeout_s=5).get(node.name, [])
            ),
            timeout_s=30,
            message="the task running",
        )
        proc, _ = ctl("-b", vhost_url, "--json", "inspect", "active", "-d", node.name, "--timeout", "5")
        assert proc.returncode == 0, output(proc)
        [task] = json.loads(proc.stdout)[node.name]
        assert (task["args"], task["kwargs"]) == ([3.0], {"tag": "hello"})  # Celery's TASK_INFO
        proc, _ = ctl(
            "-b", vhost_url, "--json", "inspect", "active", "--safe", "-d", node.name, "--timeout", "5"
        )
        [task] = json.loads(proc.stdout)[node.name]
        assert (task["args"], task["kwargs"]) == ("[3.0]", "{'tag': 'hello'}")  # their reprs
        proc, _ = ctl("-b", vhost_url, "inspect", "active", "-d", node.name, "--timeout", "5")
        assert "(3.0,) {'tag': 'hello'}" in proc.stdout, output(proc)
        assert result.get(timeout=30) == "hello"


def test_revoke_terminate_names_the_task_it_killed_to_every_copy_of_the_request(
    vhost_url: str, node: WorkerProcess
):
    # ctl logs a revoke durably, then broadcasts it, so a worker learns it twice; the first copy
    # to arrive kills the task, and the reply to either must still say it was terminated.
    with (
        App("ctl-terminate", settings=Settings(broker_url=vhost_url)) as app,
        ControlClient(Settings(broker_url=vhost_url)) as client,
    ):
        result = app.send_task("tests.integration.e2e_tasks.sleep_s", (60,), queue=node.queues[0])
        wait_for(
            lambda: any(
                t["id"] == result.id for t in client.inspect("active", timeout_s=5).get(node.name, [])
            ),
            timeout_s=30,
            message="the task running",
        )
        for _ in range(2):
            proc, _ = ctl(
                "-b",
                vhost_url,
                "--json",
                "revoke",
                result.id,
                "--terminate",
                "-d",
                node.name,
                "--timeout",
                "5",
            )
            assert proc.returncode == 0, output(proc)
            assert json.loads(proc.stdout) == {node.name: {"ok": f"terminate: {result.id}"}}


# -- events ------------------------------------------------------------------------------------------------


def test_events_prints_json_lines_ordered_by_clock_then_origin(vhost_url: str):
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    args = [CTL, "events", "-b", vhost_url, "--json", "--count", "4", "--duration", "30"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stderr], [], [], 0.5)
                if ready and "listening" in proc.stderr.readline():
                    break
            else:
                raise AssertionError("ctl events never said it was listening")
            sent = [(30, "b@h", 1), (10, "z@h", 1), (20, "b@h", 2), (20, "a@h", 9)]
            with channel(vhost_url) as ch:
                for clock, host, pid in sent:
                    event = {"type": "worker-heartbeat", "hostname": host, "pid": pid, "clock": clock,
                             "timestamp": time.time(), "freq": 2.0}  # fmt: skip
                    ch.basic_publish(EVENT_EXCHANGE, "worker.heartbeat", json.dumps(event).encode(),
                                     pika.BasicProperties(content_type="application/json",
                                                          headers={"hostname": host}))  # fmt: skip
            out, _ = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=10)
    assert proc.returncode == 0
    got = [(e["clock"], e["hostname"]) for e in map(json.loads, out.splitlines())]
    assert got == [(10, "z@h"), (20, "a@h"), (20, "b@h"), (30, "b@h")]


def _follow_events(vhost_url: str, *options: str, sent: list[dict[str, Any]]) -> tuple[str, str]:
    """Run ``ctl events`` with ``options``, publish ``sent`` once it listens; its stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if k != "CLOCKWORK_BROKER_URL"}
    args = [CTL, "events", "-b", vhost_url, *options]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            assert proc.stderr is not None
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stderr], [], [], 0.5)
                if ready and "listening" in (first := proc.stderr.readline()):
                    break
            else:
                raise AssertionError("ctl events never said it was listening")
            with channel(vhost_url) as ch:
                for clock, event in enumerate(sent, start=1):
                    body = {"hostname": "w@h", "pid": 1, "clock": clock, "timestamp": time.time(), **event}
                    key = event["type"].replace("-", ".")
                    headers = {"hostname": "w@h"}
                    properties = pika.BasicProperties(content_type="application/json", headers=headers)
                    ch.basic_publish(EVENT_EXCHANGE, key, json.dumps(body).encode(), properties)
            out, rest = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=10)
    assert proc.returncode == 0, rest
    return out, first + rest


def test_events_filters_by_type_and_by_prefix(vhost_url: str):
    sent: list[dict[str, Any]] = [
        {"type": "worker-heartbeat", "freq": 2.0},
        {"type": "task-received", "uuid": "t1", "name": "add"},
        {"type": "task-succeeded", "uuid": "t1", "runtime": 0.0123456, "result": "3"},
        {"type": "task-failed", "uuid": "t2", "exception": "ValueError()"},
        {"type": "worker-heartbeat", "freq": 2.0},
    ]
    options = ["--json", "--duration", "3"]
    out, _ = _follow_events(vhost_url, *options, "--type", "task-succeeded,task-failed", sent=sent)
    assert [e["type"] for e in map(json.loads, out.splitlines())] == ["task-succeeded", "task-failed"]
    out, _ = _follow_events(vhost_url, *options, "--type", "task-", sent=sent)
    assert [e["type"] for e in map(json.loads, out.splitlines())] == [
        "task-received",
        "task-succeeded",
        "task-failed",
    ]
    out, _ = _follow_events(
        vhost_url, "--duration", "3", "--type", "task-*", "--type", "worker-heartbeat", sent=sent
    )
    assert len(out.splitlines()) == 5, out
    assert "runtime=12.3ms" in out  # not 0.0123456


def test_events_says_task_events_need_dash_e_when_none_came(vhost_url: str):
    heartbeats: list[dict[str, Any]] = [{"type": "worker-heartbeat", "freq": 2.0}] * 2
    out, err = _follow_events(vhost_url, "--count", "2", sent=heartbeats)
    assert len(out.splitlines()) == 2
    assert "no task events seen" in err and "-E" in err and "enable-events" in err
    sent: list[dict[str, Any]] = [*heartbeats, {"type": "task-received", "uuid": "t"}]
    out, err = _follow_events(vhost_url, "--count", "1", "--type", "task-", sent=sent)
    assert "task-received" in out
    assert "no task events seen" not in err


def test_events_refuses_an_empty_type(vhost_url: str):
    proc, _ = ctl("events", "-b", vhost_url, "--type", ",", "--duration", "1")
    assert proc.returncode == 2, output(proc)
    assert "--type" in proc.stderr and "Traceback" not in proc.stderr


def test_ctl_queues_shows_depth_held_tasks_consumers_dead_letters_and_rate(
    vhost_url: str, node: WorkerProcess
):
    queue = node.queues[0]
    app = App("queues-probe", settings=Settings(broker_url=vhost_url, default_queue=queue))
    try:
        # One unknown task is dead-lettered, one slow task runs (held by the worker), five wait.
        app.send_task("no.such.task")
        app.send_task("tests.integration.e2e_tasks.sleep_s", (5.0,))
        app.send_many(app.signature("tests.integration.e2e_tasks.add", (i, i)) for i in range(5))
        app.flush(10)
        with ControlClient(Settings(broker_url=vhost_url)) as client:

            def sleeping() -> bool:
                active = client.inspect("active", destination=[node.name], timeout_s=5)
                return bool(active.get(node.name))

            wait_for(sleeping, timeout_s=20, message="the slow task did not start")
        proc, _ = ctl("queues", "-b", vhost_url, "--json", "--timeout", "5", "--interval", "0.2")
        assert proc.returncode == 0, output(proc)
        row = json.loads(proc.stdout)[queue]
        assert row["exists"] and row["consumers"] == 1 and row["dead"] == 1
        assert row["held_by_workers"] >= 1  # the sleeper, at least
        assert row["ready"] + row["held_by_workers"] >= 5
        assert isinstance(row["rate_per_s"], float)
        # Named queues, one missing; the table for a person.
        proc, _ = ctl("queues", queue, "nope-queue", "-b", vhost_url, "--timeout", "5", "--interval", "0.2")
        assert proc.returncode == 0, output(proc)
        header, *lines = proc.stdout.splitlines()
        assert header.split() == ["QUEUE", "READY", "HELD", "CONSUMERS", "DEAD", "RATE"]
        assert any(line.startswith(queue) and "no consumer" not in line for line in lines)  # it has one
        assert any(line.startswith("nope-queue") and "no such queue" in line for line in lines)
    finally:
        app.close()


def test_ctl_top_shows_workers_running_tasks_and_queues(vhost_url: str, node: WorkerProcess):
    queue = node.queues[0]
    app = App("top-probe", settings=Settings(broker_url=vhost_url, default_queue=queue))
    try:
        app.send_task("tests.integration.e2e_tasks.sleep_s", (5.0,), task_id="top-sleeper")
        app.flush(10)
        with ControlClient(Settings(broker_url=vhost_url)) as client:
            wait_for(
                lambda: bool(client.inspect("active", destination=[node.name], timeout_s=5).get(node.name)),
                timeout_s=20,
                message="the task did not start",
            )
        proc, _ = ctl("top", "-b", vhost_url, "--timeout", "5", "--interval", "0.3", "--iterations", "2")
        assert proc.returncode == 0, output(proc)
        text = proc.stdout
        assert text.count("clockwork top") == 2  # two refreshes (no screen clearing in a pipe)
        worker_row = next(line for line in text.splitlines() if line.startswith(node.name))
        assert worker_row.split()[1] == "1/1"  # one busy child of one
        assert any(line.startswith("top-sleeper") and "sleep_s" in line for line in text.splitlines())
        assert any(line.startswith(queue) for line in text.splitlines())
    finally:
        app.close()


def test_ctl_queues_marks_a_queue_whose_tasks_nobody_consumes(vhost_url: str):
    queue = f"q-unconsumed-{uuid.uuid4().hex[:8]}"
    app = App("unconsumed-probe", settings=Settings(broker_url=vhost_url, default_queue=queue))
    try:
        app.send_many(app.signature("tests.integration.e2e_tasks.add", (i, i)) for i in range(3))
        app.flush(10)
        proc, _ = ctl("queues", queue, "-b", vhost_url, "--json", "--timeout", "1", "--interval", "0.2")
        assert proc.returncode == 0, output(proc)
        row = json.loads(proc.stdout)[queue]
        assert (row["ready"], row["consumers"], row["no_consumer"]) == (3, 0, True)
        proc, _ = ctl("queues", queue, "-b", vhost_url, "--timeout", "1", "--interval", "0.2")
        [line] = [line for line in proc.stdout.splitlines() if line.startswith(queue)]
        assert "no consumer: start a worker with -Q for it" in line, output(proc)
    finally:
        app.close()
        delete_queues(vhost_url, queue)
