"""The client is a library: it never writes to its host's stdout; the host's logging decides."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.amqp import delete_queues
from tests.support.workers import ROOT, unique_queue

SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from broker_svc import App

    if sys.argv[3] == "debug":
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(message)s")
    app = App("quiet", broker=sys.argv[1])
    app.send_task("nobody.listens", queue=sys.argv[2], ignore_result=True)
    app.control.ping(timeout=0.2)
    app.close()
    print("only this")
    """
)


def _run(url: str, queue: str, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, url, queue, mode],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip


def test_a_script_using_the_client_prints_only_its_own_output(test_vhost_url: str):
    queue = unique_queue("quiet")
    try:
        quiet = _run(test_vhost_url, queue, "default")
        assert quiet.stdout == "only this\n"
        assert quiet.stderr == ""  # nothing at WARNING or above happened
        # The host turns our logs on with the standard library, and they go where it says.
        verbose = _run(test_vhost_url, queue, "debug")
        assert verbose.stdout == "only this\n"
        assert "broker_svc.connection.io_thread broker_connected" in verbose.stderr
    finally:
        delete_queues(test_vhost_url, queue)
