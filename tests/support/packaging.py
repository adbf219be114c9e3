"""Build and install Clockwork as a user does, in throwaway places: a copy of the checkout, its
wheel (``make dist``), fresh venvs.

Nothing here changes the project's venv: its pip builds a wheel (``make dist``, written into the
copy) or installs *for* another interpreter (``pip --python``). A fresh venv may borrow the project
venv's installed dependencies through a ``.pth`` file written after its install, so installing
downloads none of them and the pip that installs never sees the project's own (editable) install.
"""

from __future__ import annotations

import glob
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.workers import ROOT

__all__ = [
    "PACKAGES",
    "PROJECT",
    "PROJECT_VENV",
    "borrow_dependencies",
    "build_wheel",
    "console_scripts",
    "copy_checkout",
    "fresh_venv",
    "main_modules",
    "pip_for",
    "run",
    "shell_commands",
    "the_one",
]

PACKAGES = ("broker_svc", "control", "worker")
# pyproject.toml's [project] table: the name, version and commands a user gets.
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The venv the tests run in (``make`` calls it VENV): its pip, its installed dependencies.
PROJECT_VENV = Path(sys.prefix)
# Without git: what a working tree holds besides its source (.gitignore's entries, by name).
_NOT_SOURCE = (
    ".git", ".venv", ".broker", ".spool", "__pycache__", "*.egg-info", "build", "dist", ".*cache",
    ".hypothesis", ".bench-peers", ".reliability", ".bench-baseline",
)  # fmt: skip


def run(
    argv: Sequence[str | Path], *, cwd: Path, timeout_s: float = 120, env: dict[str, str] | None = None
) -> str:
    """Run ``argv``; its stdout, or an AssertionError with its output when it fails."""
    words = [str(arg) for arg in argv]
    done = subprocess.run(
        words, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{' '.join(words)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def console_scripts() -> dict[str, str]:
    """The commands an install puts on PATH: ``{name: "module:function"}``."""
    scripts: dict[str, str] = PROJECT["scripts"]
    return scripts


def main_modules() -> list[str]:
    """The packages' ``python -m`` entries (every ``__main__.py``), as dotted names."""
    return sorted(
        ".".join(path.relative_to(ROOT).parent.parts)
        for package in PACKAGES
        for path in (ROOT / package).rglob("__main__.py")
    )


def shell_commands(line: str) -> list[list[str]]:
    """The commands of a shell line, split on ``&&``, comments dropped (``[]`` for none)."""
    commands: list[list[str]] = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            commands.append([])
        else:
            commands[-1].append(word)
    return [command for command in commands if command]


def copy_checkout(dest: Path) -> Path:
    """The working tree's source files (tracked, or new and not ignored) copied to ``dest``.

    What a build sees in a fresh clone with this tree's changes: no venv, no build output, no caches.
    """
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, timeout=60, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*_NOT_SOURCE), dirs_exist_ok=True)
        return dest
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():  # a tracked file deleted in the working tree is not in a commit of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def build_wheel(checkout: Path) -> Path:
    """``make dist`` in ``checkout`` (the README's line), with the project venv's pip; the wheel."""
    run(["make", "dist", f"VENV={PROJECT_VENV}"], cwd=checkout, timeout_s=180)
    return the_one(checkout / "dist" / "*.whl")


def the_one(pattern: Path) -> Path:
    """The single file ``pattern`` matches (a shell glob, as in a docs line)."""
    found = glob.glob(str(pattern))
    assert len(found) == 1, f"{pattern} matches {found}, not one file"
    return Path(found[0])


def fresh_venv(path: Path) -> Path:
    """A new venv at ``path``, without pip and without system site-packages; its python."""
    path.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    return path / "bin" / "python"


def pip_for(python: Path) -> list[str]:
    """The project venv's pip, installing into (and resolving for) ``python``'s environment."""
    return [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]


def borrow_dependencies(python: Path) -> None:
    """Let ``python``'s venv import the project venv's installed packages, after its own.

    Lines of a ``.pth`` file go on ``sys.path`` as they are; the ``.pth`` files of the borrowed
    directory are not run, so the project's own editable install does not come along.
    """
    probe = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(run([python, "-c", probe], cwd=python.parent).strip())
    borrowed = dict.fromkeys(sysconfig.get_path(key) for key in ("purelib", "platlib"))
    (site / "project-venv-dependencies.pth").write_text("".join(f"{path}\n" for path in borrowed))
