"""Every command answers ``--version`` with our distribution's name and the version of the code that runs.

The commands are found where a user finds them: ``[project.scripts]`` in pyproject.toml and every
``__main__.py`` of the packages, so a command added later without ``--version`` fails here.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from broker_svc.version import DISTRIBUTION, version
from tests.support.packaging import PROJECT, console_scripts, main_modules
from tests.support.workers import ROOT

SCRIPTS = console_scripts()
MODULES = main_modules()


def test_the_distribution_is_the_one_pyproject_names():
    assert PROJECT["name"] == DISTRIBUTION
    assert version() == PROJECT["version"]  # read from this checkout


def test_every_kind_of_command_is_found():
    assert set(SCRIPTS) == {"clockwork-worker", "clockwork-beat", "ctl"}
    assert MODULES == ["control.cli", "worker", "worker.beat"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_console_script_prints_its_name_distribution_and_version(
    script: str, capsys: pytest.CaptureFixture[str]
):
    module, _, function = SCRIPTS[script].partition(":")
    main: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    with pytest.raises(SystemExit) as exited:
        main(["--version"])  # no -A, no command: --version needs neither
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert out == f"{script} ({DISTRIBUTION}) {PROJECT['version']}\n"
    assert err == ""


@pytest.mark.parametrize("module", MODULES)
def test_each_python_dash_m_entry_prints_the_version_too(module: str, tmp_path: Path):
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith(f" ({DISTRIBUTION}) {PROJECT['version']}\n")
    assert done.stdout.split()[0] in SCRIPTS  # named as the console script it is the same as


def _version_from(tree: Path) -> str:
    # broker_svc/version.py alone, in a tree of its own: what it reads from beside itself.
    (tree / "broker_svc").mkdir(parents=True)
    (tree / "broker_svc" / "__init__.py").write_text("")
    shutil.copy(ROOT / "broker_svc" / "version.py", tree / "broker_svc" / "version.py")
    probe = "from broker_svc.version import version; print(version())"
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); {probe}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_checkouts_pyproject_gives_the_version(tmp_path: Path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "Clockwork_Tasks"\nversion = "9.8.7"\n')
    assert _version_from(tmp_path) == "9.8.7"


def test_another_projects_pyproject_is_not_read(tmp_path: Path):
    # A project that vendors our packages beside its own pyproject: its version is not ours. With
    # no metadata of ours on an isolated interpreter's path either, the answer says so.
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "their-app"\nversion = "9.8.7"\n')
    found = _version_from(tmp_path)
    assert found != "9.8.7"
    assert found in ("unknown", version())  # "unknown", unless this Python has ours installed
