"""The docs' runnable code blocks, run as written: the README's first task cannot rot.

A fenced block preceded by ``<!-- doc-test: KIND [ARG] -->`` takes part (the comment does not
show on a rendered page). Per document, in order, in a fresh directory and vhost:

- ``file NAME``: the block is written to ``NAME`` (a path: ``proj/tasks.py``);
- ``worker``: the block is a worker command line, started there in the background (ready when it
  logs ``worker_ready``), stopped at the end;
- ``run``: the block is Python, run there; it must exit 0 (its ``assert`` lines are the checks);
- ``install``: the block is shell lines that install Clockwork, each one way; they are run by
  ``tests/integration/test_install.py``, each into a fresh venv, not here.

The broker is given as ``$CLOCKWORK_BROKER_URL``, as a reader's shell would give it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.infra.session_broker import SessionBroker
from tests.support.waiting import wait_for
from tests.support.workers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARKER = re.compile(r"^<!-- doc-test: (file|worker|run|install)(?: (\S+))? -->\s*$")
_FENCE = re.compile(r"^```")


@dataclass(frozen=True)
class Step:
    kind: str
    arg: str | None
    code: str
    line: int


def steps_of(path: Path) -> list[Step]:
    """The runnable blocks of one document, in order.

    Raises:
        AssertionError: a marker not followed by a fenced block.
    """
    lines = path.read_text().splitlines()
    out: list[Step] = []
    for number, line in enumerate(lines):
        found = _MARKER.match(line)
        if found is None:
            continue
        start = number + 1
        assert start < len(lines) and _FENCE.match(lines[start]), (
            f"{path.name}:{number + 1}: no block after marker"
        )
        end = next((i for i in range(start + 1, len(lines)) if _FENCE.match(lines[i])), None)
        assert end is not None, f"{path.name}:{number + 1}: unclosed block"
        out.append(Step(found.group(1), found.group(2), "\n".join(lines[start + 1 : end]) + "\n", number + 1))
    return out


RUNNABLE = [path for path in DOCS if steps_of(path)]


def test_the_readme_has_runnable_blocks():
    assert ROOT / "README.md" in RUNNABLE


@pytest.fixture
def vhost(session_broker: SessionBroker) -> Iterator[str]:
    with session_broker.own_vhost("clockwork-docs") as url:
        yield url


@pytest.mark.parametrize("doc", RUNNABLE, ids=[p.name for p in RUNNABLE])
def test_a_documents_runnable_blocks_run_as_written(doc: Path, vhost: str, tmp_path: Path):
    env = {**os.environ, "CLOCKWORK_BROKER_URL": vhost, "CLOCKWORK_STATE_DIR": str(tmp_path / "state")}
    env.pop("PYTHONPATH", None)  # what the reader has: the installed package and this directory
    workers: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        for step in steps_of(doc):
            where = f"{doc.name}:{step.line}"
            if step.kind == "file":
                assert step.arg, f"{where}: 'file' needs a name"
                (tmp_path / step.arg).parent.mkdir(parents=True, exist_ok=True)  # proj/tasks.py
                (tmp_path / step.arg).write_text(step.code)
            elif step.kind == "worker":
                workers.append(_start_worker(step.code, tmp_path, env, where))
            elif step.kind == "install":
                continue  # tests/integration/test_install.py
            else:
                script = tmp_path / f"doc_step_{step.line}.py"
                script.write_text(step.code)
                result = subprocess.run(
                    [sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                    timeout=120, check=False,
                )  # fmt: skip
                logs = "\n".join(log.read_text()[-2000:] for _, log in workers)
                assert result.returncode == 0, f"{where} failed:\n{result.stderr[-3000:]}\nworkers:\n{logs}"
    finally:
        for proc, _ in workers:
            proc.terminate()
        for proc, _ in workers:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _start_worker(
    code: str, cwd: Path, env: dict[str, str], where: str
) -> tuple[subprocess.Popen[bytes], Path]:
    [command] = [line for line in code.splitlines() if line.strip() and not line.startswith("#")]
    argv = shlex.split(command.removeprefix("$ "), comments=True)
    installed = Path(sys.executable).with_name(argv[0])  # the venv's script, as on the reader's PATH
    if installed.exists():
        argv[0] = str(installed)
    log = cwd / f"worker-{len(argv)}-{abs(hash(command))}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"{where}: the worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        return "worker_ready" in log.read_text()

    wait_for(ready, timeout_s=60, message=f"{where}: the worker did not start:\n{log.read_text()[-3000:]}")
    return proc, log
