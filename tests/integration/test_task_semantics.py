"""Task semantics as Celery users expect them: bound requests, retries, limits, states, hooks."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker_svc import App, ResultTimeout, TaskError, TaskRevokedError
from tests.support.amqp import drain, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import WorkerProcess

T = "tests.integration.semantics_tasks."


_SHAPES = {
    "children": [],
    "children-threads": ["--threads", "2"],
}


@pytest.fixture(params=list(_SHAPES))
def sem_worker(request: pytest.FixtureRequest, test_vhost_url: str, queue: str) -> Iterator[WorkerProcess]:
    # Each pool child consumes; with --threads, each thread of each child.
    extra = _SHAPES[request.param]
    with WorkerProcess(
        test_vhost_url, app=T.rstrip(".") + ":app", queues=[queue], concurrency=2, extra_args=extra
    ) as proc:
        yield proc.wait_ready()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_bound_task_sees_its_request(client: App, queue: str, sem_worker: WorkerProcess):
    result = client.send_task(T + "report_request", queue=queue, task_id="req-1")
    request = result.get(timeout=30)
    assert request["id"] == "req-1" and request["retries"] == 0 and request["called_directly"] is False
    assert request["hostname"] == sem_worker.name
    assert request["routing_key"] == queue
    assert request["root_id"] == "req-1" and request["parent_id"] is None
    assert request["correlation_id"] == "req-1" and request["reply_to"]


def test_tasks_sent_from_a_task_get_parent_and_root_ids(client: App, queue: str, sem_worker: WorkerProcess):
    outcome = client.send_task(T + "spawn_child", (queue,), queue=queue).get(timeout=60)
    assert outcome["child"]["parent_id"] == outcome["me"]
    assert outcome["child"]["root_id"] == outcome["me"]


def test_retry_resends_the_same_id_then_fails_and_dead_letters(
    client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path, test_vhost_url: str
):
    log = tmp_path / "attempts.jsonl"
    states: list[str] = []
    result = client.send_task(T + "always_retry", (str(log), 0.2), queue=queue, task_id="retry-1")
    with pytest.raises(ValueError, match="attempt 3") as info:
        result.get(timeout=60, on_message=lambda body: states.append(body["status"]))
    assert isinstance(info.value, TaskError)
    assert [a["attempt"] for a in _lines(log)] == [0, 1, 2, 3]  # max_retries=3: 1 run + 3 retries
    assert states == ["RETRY", "RETRY", "RETRY", "FAILURE"]
    dead = wait_for(lambda: drain(test_vhost_url, f"{queue}.dead"), timeout_s=20, message="no dead letter")
    assert dead[0].headers["x-clockwork-reason"] == "max_retries_exceeded"
    assert dead[0].headers["id"] == "retry-1" and dead[0].headers["retries"] == 3
    assert sem_worker.count("task_retried") == 3


def test_a_retried_task_can_still_succeed(client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path):
    log = tmp_path / "attempts.jsonl"
    assert client.send_task(T + "succeeds_on_third", (str(log),), queue=queue).get(timeout=60) == 2
    assert [a["attempt"] for a in _lines(log)] == [0, 1, 2]


def test_autoretry_follows_the_exponential_backoff_schedule(
    client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path
):
    log = tmp_path / "attempts.jsonl"
    with pytest.raises(KeyError):
        client.send_task(T + "backoff", (str(log),), queue=queue).get(timeout=60)
    times = [a["at"] for a in _lines(log)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(gaps) == 3
    for gap, expected in zip(gaps, [0.4, 0.8, 1.6], strict=True):  # retry_backoff=0.4, no jitter
        assert expected - 0.05 <= gap <= expected + 1.0, gaps


def test_soft_time_limit_raises_inside_the_task(
    client: App, queue: str, sem_worker: WorkerProcess, request: pytest.FixtureRequest
):
    started = time.monotonic()
    assert client.send_task(T + "soft_limited", queue=queue).get(timeout=30) == "soft limit caught"
    if request.node.callspec.params["sem_worker"] != "children-threads":
        assert time.monotonic() - started < 4  # it cut the 5 s sleep short
    # In a thread the limit lands at the next bytecode, after the sleep (a documented limit;
    # test_children_threads.py shows it cutting a Python loop short).


def test_hard_time_limit_kills_the_child_and_the_next_task_runs(
    client: App, queue: str, sem_worker: WorkerProcess
):
    result = client.send_task(T + "hard_limited", queue=queue)
    with pytest.raises(TaskError) as info:
        result.get(timeout=30)
    assert info.value.exc_type == "TimeLimitExceeded"
    pids = {client.send_task(T + "sleeper", (0.05,), queue=queue).get(timeout=30) for _ in range(4)}
    assert len(pids) >= 1  # the pool is serving again, on a replaced child


def test_per_call_time_limit_wins(client: App, queue: str, sem_worker: WorkerProcess):
    started = time.monotonic()
    with pytest.raises(TaskError) as info:
        client.send_task(T + "sleeper", (5,), queue=queue, time_limit=1).get(timeout=30)
    assert info.value.exc_type == "TimeLimitExceeded" and time.monotonic() - started < 4


def test_worker_wide_default_time_limit(test_vhost_url: str, queue: str, client: App):
    with WorkerProcess(
        test_vhost_url, app=T.rstrip(".") + ":app", queues=[queue], extra_args=["--time-limit", "1"]
    ) as proc:
        proc.wait_ready()
        with pytest.raises(TaskError) as info:
            client.send_task(T + "sleeper", (5,), queue=queue).get(timeout=30)
        assert info.value.exc_type == "TimeLimitExceeded"


def test_an_expired_task_is_not_run_and_is_revoked(
    client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path, test_vhost_url: str
):
    marker = tmp_path / "ran"
    result = client.send_task(
        T + "no_result",
        (str(marker),),
        queue=queue,
        expires=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1),
    )
    # ignore_result tasks publish nothing; use one that replies to see REVOKED.
    revoked = client.send_task(
        T + "now", queue=queue, expires=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    )
    with pytest.raises(TaskRevokedError, match="expired"):
        revoked.get(timeout=30)
    assert revoked.state == "REVOKED"
    assert not marker.exists()
    del result
    wait_for(lambda: queue_depth(test_vhost_url, queue) == 0, timeout_s=10, message="expired tasks not acked")


def test_progress_states_reach_the_client_in_order(client: App, queue: str, sem_worker: WorkerProcess):
    seen: list[tuple[str, Any]] = []
    result = client.send_task(T + "progress", (3,), queue=queue)
    assert result.get(timeout=30, on_message=lambda b: seen.append((b["status"], b["result"]))) == "done"
    assert [s for s, _ in seen] == ["STARTED", "PROGRESS", "PROGRESS", "PROGRESS", "SUCCESS"]
    assert seen[0][1]["hostname"] == sem_worker.name and seen[0][1]["pid"] > 0
    assert [m["step"] for s, m in seen if s == "PROGRESS"] == [0, 1, 2]


def test_hooks_run_exactly_once_and_a_raising_hook_changes_nothing(
    client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path
):
    ok, bad, broken = tmp_path / "ok", tmp_path / "bad", tmp_path / "broken"
    assert client.send_task(T + "hooked", (str(ok),), queue=queue).get(timeout=30) == "ok"
    with pytest.raises(ValueError):
        client.send_task(T + "hooked", (str(bad),), {"fail": True}, queue=queue).get(timeout=30)
    assert (
        client.send_task(T + "hooked", (str(broken),), {"break_hook": True}, queue=queue).get(timeout=30)
        == "ok"
    )
    assert [e["hook"] for e in _lines(ok)] == ["on_success", "after_return"]
    assert _lines(ok)[1]["status"] == "SUCCESS"
    assert [e["hook"] for e in _lines(bad)] == ["on_failure", "after_return"]
    assert _lines(bad)[0]["has_tb"] is True and _lines(bad)[1]["status"] == "FAILURE"
    assert [e["hook"] for e in _lines(broken)] == ["on_success", "after_return"]
    wait_for(
        lambda: sem_worker.count("task_hook_failed") == 1, timeout_s=10, message="hook failure not logged"
    )


def test_ignore_result_publishes_nothing(client: App, queue: str, sem_worker: WorkerProcess, tmp_path: Path):
    marker = tmp_path / "ran"
    result = client.send_task(T + "no_result", (str(marker),), queue=queue)
    wait_for(marker.exists, timeout_s=30, message="task did not run")
    with pytest.raises(ResultTimeout):
        result.get(timeout=1.5)


def test_a_value_that_cannot_be_encoded_names_its_task_on_send_and_on_result(
    client: App, queue: str, sem_worker: WorkerProcess
):
    with pytest.raises(TypeError, match=r"cannot send task 'tests\.integration\.semantics_tasks\.now' \(id "):
        client.send_task(T + "now", (object(),), queue=queue)
    result = client.send_task(T + "unencodable", queue=queue)
    with pytest.raises(TaskError) as info:
        result.get(timeout=30)
    assert info.value.exc_type == "EncodeError"
    named = f"the result of task '{T}unencodable' (id {result.id}) cannot be encoded"
    assert named in str(info.value)
    logged = sem_worker.first("task_result_not_encodable")
    assert named in logged["error"] and logged["task_id"] == result.id
