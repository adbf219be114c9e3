"""The README's install lines, run as written, each into a fresh venv; then every command from it.

In a copy of this checkout (a build writes nothing into the tree): ``make dist`` builds the wheel
with the project venv's pip; each ``pip install`` line installs into a venv of its own, made
without system site-packages, with ``--no-deps``: the runtime dependencies are borrowed from the
project venv afterwards (tests/support/packaging.py), so nothing is downloaded but what pip's
isolated build of a path or a git URL needs (setuptools, from the index or pip's cache). The git
URL's placeholder is pointed at a git repository made of the copy.
"""

from __future__ import annotations

import configparser
import os
import zipfile
from pathlib import Path

import pytest

from broker_svc.version import DISTRIBUTION
from tests.integration.test_docs_run import DOCS, steps_of
from tests.support.packaging import (
    PACKAGES,
    PROJECT,
    borrow_dependencies,
    build_wheel,
    console_scripts,
    copy_checkout,
    fresh_venv,
    main_modules,
    pip_for,
    run,
    shell_commands,
    the_one,
)

# The README's stand-in for wherever a reader's copy of the repository lives.
PLACEHOLDER = "https://git.example.com/YOUR-ORG/clockwork.git"
VERSION: str = PROJECT["version"]


def _install_lines() -> list[tuple[str, list[list[str]]]]:
    """``(doc:line, commands)`` for each line of the docs' install blocks; ``&&`` splits commands."""
    found = []
    for doc in DOCS:
        for step in steps_of(doc):
            if step.kind != "install":
                continue
            # step.line is the marker's line; the fence follows it, then the block.
            for number, line in enumerate(step.code.splitlines(), start=step.line + 2):
                commands = shell_commands(line)
                if commands:
                    found.append((f"{doc.name}:{number}", commands))
    return found


INSTALLS = _install_lines()


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the working tree, committed to a git repository of its own (branch main)."""
    copy = copy_checkout(tmp_path_factory.mktemp("checkout"))
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid"]
    run([*git, "init", "-q", "-b", "main"], cwd=copy)
    run([*git, "add", "-A"], cwd=copy)
    run([*git, "commit", "-q", "-m", "the working tree"], cwd=copy)
    return copy


def _reader_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # a reader's shell: the installed packages, not this tree
    return env


def test_the_readme_installs_from_a_wheel_a_path_and_a_git_url():
    lines = [" ".join(" ".join(c) for c in commands) for where, commands in INSTALLS if "README" in where]
    assert any("make dist" in line and ".whl" in line for line in lines), lines
    assert "pip install ." in lines
    assert any(f"git+{PLACEHOLDER}@" in line for line in lines), lines


def test_the_wheel_holds_every_module_py_typed_and_the_commands_and_no_tests(checkout: Path):
    wheel = build_wheel(checkout)
    assert wheel.name == f"{DISTRIBUTION.replace('-', '_')}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"{DISTRIBUTION.replace('-', '_')}-{VERSION}.dist-info"
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {*PACKAGES, info}  # no tests/, bench/, examples/
    sources = [path for package in PACKAGES for path in (checkout / package).rglob("*.py")]
    assert {str(path.relative_to(checkout)) for path in sources} - names == set()
    assert {f"{package}/py.typed" for package in PACKAGES} <= names
    parsed = configparser.ConfigParser()
    parsed.read_string(entry_points)
    assert dict(parsed["console_scripts"]) == console_scripts()


@pytest.mark.parametrize(("where", "commands"), INSTALLS, ids=[where for where, _ in INSTALLS])
def test_each_install_line_gives_commands_that_run(
    where: str, commands: list[list[str]], checkout: Path, tmp_path: Path
):
    python = None
    for argv in commands:
        if argv == ["make", "dist"]:
            build_wheel(checkout)
        elif argv[:2] == ["pip", "install"]:
            assert python is None, f"{where}: one install per line"
            python = fresh_venv(tmp_path / "venv")
            # pip takes a git+file URL only with a host; git reads localhost as this machine.
            args = [arg.replace(PLACEHOLDER, f"file://localhost{checkout}") for arg in argv[2:]]
            args = [str(the_one(checkout / arg)) if "*" in arg else arg for arg in args]
            run([*pip_for(python), "install", "--no-deps", *args], cwd=checkout, timeout_s=180)
        else:
            raise AssertionError(f"{where}: this test runs 'make dist' and 'pip install ...', not {argv}")
    assert python is not None, f"{where}: the line installs nothing"
    borrow_dependencies(python)
    _check_commands(python, cwd=tmp_path)


def _check_commands(python: Path, *, cwd: Path) -> None:
    env, bin_dir = _reader_env(), python.parent
    for script in console_scripts():
        out = run([bin_dir / script, "--version"], cwd=cwd, env=env)
        assert out == f"{script} ({DISTRIBUTION}) {VERSION}\n"
    for module in main_modules():
        out = run([python, "-m", module, "--version"], cwd=cwd, env=env)
        assert out.endswith(f" ({DISTRIBUTION}) {VERSION}\n"), (module, out)
    usage = run([bin_dir / "ctl", "--help"], cwd=cwd, env=env)
    assert "inspect" in usage and "--version" in usage
    # The packages and their metadata are the venv's own, not this checkout's or the project venv's.
    probe = (
        "import importlib.metadata, broker_svc, control, worker\n"
        "print(broker_svc.__file__, control.__file__, worker.__file__)\n"
        f"print(importlib.metadata.distribution({DISTRIBUTION!r}).locate_file(''))"
    )
    venv = str(python.parent.parent)
    for path in run([python, "-c", probe], cwd=cwd, env=env).split():
        assert path.startswith(venv), (path, venv)
