"""Starting a worker: one clear line for a start-up error, and ``clockwork-worker -A`` from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from broker_svc import App, Settings
from tests.support.amqp import delete_queues
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

SCRIPT = Path(sys.executable).with_name("clockwork-worker")


def _start(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "worker", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["-A", "nosuch.module:app"], "no module named 'nosuch'"),
        (["-A", "tests.integration.e2e_tasks:nothing"], "has no attribute 'nothing'"),
        (["-A", "tests.integration.e2e_tasks:add"], "not a broker_svc.App"),
        (["-A", "bad spec!"], "bad app spec"),
        (["-A", "tests.integration.e2e_tasks:app", "-l", "loud"], "unknown log level 'loud'"),
        (["-A", "tests.integration.e2e_tasks:app", "-c", "0"], "at least 1"),
        (["-A", "tests.integration.e2e_tasks:app", "-Q", ","], "names no queue"),
    ],
)
def test_a_start_up_error_is_one_line_and_exit_status_2(args: list[str], said: str):
    result = _start(*args)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr  # argparse adds its usage line


BROKEN_APPS = {
    "typo": "from broker_svc import App\n\napp = App('typo')\n\ndef add(x, y:\n    return x + y\n",
    "dbresults": "from broker_svc import App\n\napp = App('dbresults', backend='db+sqlite:///results.db')\n",
}


@pytest.mark.parametrize(
    ("command", "module", "said"),
    [
        ("worker", "typo", "SyntaxError in {path}, line 5: "),
        ("worker", "dbresults", "result backend 'db+sqlite:///results.db' is not supported"),
        ("worker.beat.cli", "typo", "SyntaxError in {path}, line 5: "),
        ("worker.beat.cli", "dbresults", "result backend 'db+sqlite:///results.db' is not supported"),
    ],
)
def test_an_app_module_that_does_not_load_is_one_line_and_exit_status_2(
    command: str, module: str, said: str, tmp_path: Path
):
    """A syntax error or a refused setting in the user's module: the fact and its line, no traceback."""
    path = tmp_path / f"{module}.py"
    path.write_text(BROKEN_APPS[module])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", command, "-A", f"{module}:app"]
    result = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"cannot load app '{module}:app'" in result.stderr
    assert said.format(path=path) in result.stderr
    if module == "dbresults":
        assert f"({path}, line 3)" in result.stderr  # the user's line that set it


def test_debug_adds_the_traceback():
    result = _start("-A", "nosuch.module:app", "-l", "debug")
    assert result.returncode == 2 and "Traceback" in result.stderr


def test_clockwork_worker_loads_an_app_from_the_current_directory(test_vhost_url: str, tmp_path: Path):
    """The installed script, run where the app's file is, as ``celery -A`` is."""
    assert SCRIPT.exists(), f"{SCRIPT} is not installed (pip install -e .)"
    queue = unique_queue("cwd")
    # A file named like our package must not replace it (``python -m worker`` would pick it up).
    (tmp_path / "worker.py").write_text("raise SystemExit('the user\\'s worker.py was imported')\n")
    (tmp_path / "myjobs.py").write_text(
        textwrap.dedent(
            f"""
            from broker_svc import App

            app = App("myjobs", broker={test_vhost_url!r}, task_default_queue={queue!r})


            @app.task
            def shout(word):
                return word.upper()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(SCRIPT), "-A", "myjobs", "-c", "1", "--statedb", "none"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    client = App("cwd-client", settings=Settings(broker_url=test_vhost_url, default_queue=queue))
    try:
        wait_for(
            lambda: proc.poll() is not None or "worker_ready" in log.read_text(),
            timeout_s=60,
            message="the worker did not start",
        )
        assert proc.poll() is None, log.read_text()[-3000:]
        assert client.send_task("myjobs.shout", ("hi",)).get(timeout=30) == "HI"  # run by a pool child
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=60)
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_ctrl_c_while_the_broker_is_unreachable_stops_quietly(tmp_path: Path):
    # Port 9 (discard) refuses the connection: the worker waits for a broker that never comes.
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "-A", "tests.integration.e2e_tasks:app", "-c", "1",
             "-b", "amqp://guest:guest@127.0.0.1:9/", "--statedb", "none"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_for(lambda: "broker" in log.read_text(), timeout_s=60, message="no broker wait logged")
        time.sleep(0.5)
        proc.send_signal(2)  # SIGINT, as Ctrl-C
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert "pool_child_died_idle" not in text, text[-3000:]  # the pool is closed, not found dead
    assert status in (0, 130), text[-3000:]


def test_a_refused_login_is_one_line_and_exit_status_1(test_vhost_url: str):
    bad = test_vhost_url.replace("guest:guest@", "guest:not-the-password@", 1)
    assert bad != test_vhost_url
    result = _start("-A", "tests.integration.e2e_tasks:app", "-c", "1", "-b", bad, "--statedb", "none")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("clockwork-worker: error:") and "refused" in last.lower(), last


def test_an_unknown_vhost_is_one_line_naming_it_and_exit_status_1(test_vhost_url: str):
    # The broker closes the connection as it opens the vhost: retrying cannot help, so the worker
    # says so at once instead of retrying forever.
    parts = urlsplit(test_vhost_url)
    bad = urlunsplit(parts._replace(path="/clockwork-no-such-vhost"))
    started = time.monotonic()
    result = _start("-A", "tests.integration.e2e_tasks:app", "-c", "1", "-b", bad, "--statedb", "none")
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 30
    assert "Traceback" not in result.stderr and "object at 0x" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("clockwork-worker: error:"), last
    assert "vhost 'clockwork-no-such-vhost'" in last and "'guest'" in last, last


def test_a_worker_warns_when_another_app_consumes_its_queue(test_vhost_url: str):
    """Two apps on one queue: the second worker names the first and a task it would dead-letter."""

    queue = unique_queue("shared")
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as first:
        first.wait_ready()
        with WorkerProcess(
            test_vhost_url, app="tests.integration.canvas_tasks:app", queues=[queue], concurrency=1
        ) as second:
            second.wait_ready()
            warning = second.first("queue_shared_with_another_app", timeout_s=30)
            assert warning["peer"] == first.name and warning["queues"] == [queue]
            assert (
                "tests.integration.e2e_tasks.add" in warning["their_tasks"] or warning["their_task_count"] > 5
            )
    # Two workers of the same app share a queue as intended: no warning.
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as a:
        a.wait_ready()
        with WorkerProcess(test_vhost_url, queues=[queue], concurrency=1) as b:
            b.wait_ready()
            done = b.first("shared_queue_check_done", timeout_s=30)
            assert done["peers_sharing"] >= 1 and done["other_apps"] == 0
            assert a.count("queue_shared_with_another_app") == 0
            assert b.count("queue_shared_with_another_app") == 0
    delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_a_celery_setting_that_does_nothing_here_is_warned_once_per_worker(
    test_vhost_url: str, tmp_path: Path
):
    """The worker, its forkserver and each child import the app: the warning comes from the worker alone."""
    queue = unique_queue("warned")
    (tmp_path / "warned_app.py").write_text(
        textwrap.dedent(
            """
            from broker_svc import App

            app = App("warned_app")
            app.conf.worker_enable_remote_control_unknown_here = True


            @app.task
            def fail():
                raise ValueError("logged by the child")
            """
        )
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    client = App("warned-client", settings=Settings(broker_url=test_vhost_url, default_queue=queue))
    try:
        with WorkerProcess(
            test_vhost_url, app="warned_app:app", queues=[queue], concurrency=2, env=env
        ) as worker:
            worker.wait_ready()
            with pytest.raises(ValueError, match="logged by the child"):
                client.send_task("warned_app.fail").get(timeout=30)
            worker.first("task_failed")  # the children log as before
            text = worker.log_text()
            assert text.count("celery_setting_not_used") == 1, text[-4000:]
    finally:
        client.close()
        delete_queues(test_vhost_url, queue, f"{queue}.dead")


def test_a_started_worker_says_at_info_only_what_a_user_needs(test_vhost_url: str):
    """Celery prints a banner and 'ready': ours is worker_ready (the banner) and mingle_done.

    The worker logs at debug here, so the test can wait until every start-up step has logged,
    then count the lines at info.
    """
    queue = unique_queue("quiet-start")
    with WorkerProcess(test_vhost_url, queues=[queue], concurrency=2) as worker:
        worker.wait_ready()
        steps = {"shared_queue_check_done": 1, "chord_joiner_subscribed": 1, "dedup_gate_subscribed": 1,
                 "revocation_log_read": 1, "feed_child_consuming": 2, "dedup_gate_active": 8}  # fmt: skip

        def started() -> bool:
            return all(worker.count(event) >= n for event, n in steps.items())

        wait_for(
            started, timeout_s=60, message=f"start-up steps not all logged:\n{worker.log_text()[-4000:]}"
        )
        infos = [e["event"] for e in worker.events() if e.get("level") == "info"]
        assert infos == ["mingle_done", "worker_ready"], infos
    delete_queues(test_vhost_url, queue, f"{queue}.dead")
