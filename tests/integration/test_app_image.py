"""examples/docker/Dockerfile's build steps, carried out outside Docker, make an app that runs.

As docs/deployment.md tells a reader ("Building an image of your app"): ``make dist`` in a copy of
this checkout, the wheel copied into the recipe's ``wheels/``, then the Dockerfile's stages
(tests/support/dockerfile.py): the builder's ``pip wheel`` resolves every dependency from the
package index (as a build on the reader's machine does; pip's cache makes a second run quick) and
the runtime's ``pip install --no-index`` installs them into a fresh venv from those wheels alone.
The image's command then runs from that venv, in its working directory, and a task sent by name
is run by it. Only the steps that need root and Debian (apt-get, useradd, chown) are skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_svc import App, Settings
from tests.infra.session_broker import SessionBroker
from tests.support.dockerfile import build_outside_docker, exec_form, read_stages
from tests.support.packaging import build_wheel, copy_checkout, run
from tests.support.waiting import wait_for
from tests.support.workers import ROOT

RECIPE = ROOT / "examples" / "docker"
# Commands of the Dockerfile that need root and Debian: not run here.
SYSTEM_COMMANDS = {"apt-get", "rm", "groupadd", "useradd", "chown"}


@pytest.fixture
def vhost(session_broker: SessionBroker) -> Iterator[str]:
    # The recipe's app uses the default queue, celery: a vhost of its own keeps it apart.
    with session_broker.own_vhost("clockwork-image") as url:
        yield url


def test_the_dockerfiles_steps_build_a_worker_that_runs_a_task(vhost: str, tmp_path: Path):
    checkout = copy_checkout(tmp_path / "checkout")
    context = tmp_path / "context"
    shutil.copytree(RECIPE, context)
    shutil.copy(build_wheel(checkout), context / "wheels")
    stages = read_stages((context / "Dockerfile").read_text())

    builder, *_, runtime = build_outside_docker(stages, context, tmp_path / "image")

    assert [argv[:2] for argv in builder.pip_commands] == [["pip", "wheel"]]
    assert [argv[:2] for argv in runtime.pip_commands] == [["pip", "install"]]
    assert {argv[0] for argv in builder.skipped + runtime.skipped} <= SYSTEM_COMMANDS
    # The runtime's venv (no system site-packages, nothing borrowed) holds Clockwork and all it needs.
    probe = "import broker_svc; print(broker_svc.__file__)"
    where = run([runtime.python, "-c", probe], cwd=tmp_path, env=_env())
    assert where.startswith(str(runtime.python.parent.parent)), where
    [cmd] = stages[-1].all("CMD")
    argv = exec_form(cmd)
    argv[0] = str(runtime.python.parent / argv[0])  # the console script, as on the image's PATH
    assert run([argv[0], "--version"], cwd=tmp_path, env=_env()).startswith(f"{Path(argv[0]).name} (")

    env = {
        **_env(),
        **runtime.env,
        "CLOCKWORK_BROKER_URL": vhost,
        "CLOCKWORK_STATE_DIR": str(runtime.path(runtime.env["CLOCKWORK_STATE_DIR"])),
    }
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        worker = subprocess.Popen(argv, cwd=runtime.path("."), env=env, stdout=out, stderr=subprocess.STDOUT)
    client = App("image-client", settings=Settings(broker_url=vhost))
    try:
        wait_for(
            lambda: worker.poll() is not None or "worker_ready" in log.read_text(),
            timeout_s=60,
            message="the image's worker did not start",
        )
        assert worker.poll() is None, log.read_text()[-3000:]
        assert client.send_task("myapp.tasks.add", (2, 3)).get(timeout=30) == 5
    finally:
        client.close()
        worker.send_signal(signal.SIGTERM)  # what tini forwards on docker stop
        try:
            status = worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
            raise
    assert status == 0, log.read_text()[-3000:]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the image has the installed packages, not this tree
    return env
