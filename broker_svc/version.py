"""Our distribution's name and version: what ``--version``, events and ``inspect report`` print."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, Final

__all__ = ["DISTRIBUTION", "UNKNOWN_VERSION", "add_version_option", "version", "version_line"]

# The name on the package index (``pip install clockwork-tasks``); PyPI's ``clockwork`` is another
# project. The import packages keep their names: broker_svc, control, worker.
DISTRIBUTION: Final = "clockwork-tasks"
UNKNOWN_VERSION: Final = "unknown"


@cache
def version() -> str:
    """The version of the code that runs.

    From a checkout (an editable install, or ``PYTHONPATH``), its ``pyproject.toml``: an editable
    install's metadata is as old as the install, and a tree on ``PYTHONPATH`` has none. Otherwise
    the installed distribution's metadata; ``"unknown"`` when neither is there.
    """
    checkout = _checkout_version()
    if checkout is not None:
        return checkout
    from importlib import metadata  # it imports email, zipfile, csv: only for whoever asks

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


def version_line(prog: str) -> str:
    """``ctl (clockwork-tasks) 0.1.0``: the command, the distribution it belongs to, the version."""
    return f"{prog} ({DISTRIBUTION}) {version()}"


def add_version_option(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` a ``--version`` that prints :func:`version_line` to stdout and exits 0.

    The version is looked up only when ``--version`` is given, so every other run of the command
    (``ctl inspect ping`` above all) starts without reading metadata.
    """
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")


class _VersionAction(argparse.Action):
    # argparse's own "version" action wants the text when the parser is built.
    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        sys.stdout.write(version_line(parser.prog) + "\n")
        parser.exit()


def _checkout_version() -> str | None:
    # The packages sit at the top of a checkout, beside its pyproject.toml; installed, their
    # parent is site-packages, which has none. Another project's pyproject (a tree that vendors
    # our packages) names another distribution and is not ours to read.
    import tomllib

    try:
        with (Path(__file__).resolve().parents[1] / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    if _normalized(str(project.get("name", ""))) != _normalized(DISTRIBUTION):
        return None
    found = project.get("version")
    return found if isinstance(found, str) else None


def _normalized(name: str) -> str:
    # PEP 503: case and runs of "-", "_", "." do not tell names apart.
    return re.sub(r"[-_.]+", "-", name).lower()
