"""``make run``'s demo (``examples/demo.py``), one of the README's two set-up commands, end to end.

It starts a worker, sends the demo tasks, prints their results, asks the worker through ``ctl`` and
stops it; here against a vhost of its own, with its spool in the test's directory.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.infra.session_broker import SessionBroker
from tests.support.workers import ROOT


def test_the_demo_runs_its_tasks_asks_the_worker_and_stops_it_cleanly(
    session_broker: SessionBroker, tmp_path: Path
):
    with session_broker.own_vhost("clockwork-demo") as url:
        env = {
            **os.environ,
            "CLOCKWORK_BROKER_URL": url,
            "CLOCKWORK_SPOOL_DIR": str(tmp_path / "spool"),
            "PYTHONPATH": str(ROOT),
        }
        done = subprocess.run(
            [sys.executable, "-m", "examples.demo"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, (out, done.stderr[-3000:])
    for line in (
        "add(2, 3) = 5",
        "word_count('the cat and the hat') = {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}",
        "fail('bad input') -> FAILURE: ValueError: bad input",
        "1000 x add: sum=999000",
        "1 node online.",
        "examples.tasks.word_count",  # in ``ctl inspect registered``
        "worker stopped with exit status 0",
    ):
        assert line in out, (line, out)
    assert re.search(r"demo@\S+ +up [0-9.]+ s, \d+ tasks done", out), out  # ``ctl inspect stats``
