"""Statements of the docs checked against the code they describe, so neither drifts from the other."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from worker.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` (a whole line), up to the next heading of any level."""
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("#") and lines[i - 1] == ""), len(lines)
    )
    return "\n".join(lines[start:end])


def _documented_worker_options() -> set[str]:
    # The first column of the guide's worker options table: `-A/--app`, `--logfile/-f PATH`,
    # `-O fair` / `-P prefork`, ...
    rows = [
        line for line in _section(GUIDE.read_text(), "## The worker").splitlines() if line.startswith("| `")
    ]
    assert rows, "no options table under '## The worker'"
    options: set[str] = set()
    for row in rows:
        first = row.split("|")[1]
        for code in re.findall(r"`([^`]+)`", first):
            options.update(part for part in code.split()[0].split("/") if part.startswith("-"))
    return options


def _parser_options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions  # argparse keeps no public list of its options
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
    }


def test_the_worker_options_table_lists_exactly_the_options_the_worker_takes() -> None:
    documented, taken = _documented_worker_options(), _parser_options(build_parser())
    assert sorted(taken - documented) == [], "options the worker takes that the guide's table leaves out"
    assert sorted(documented - taken) == [], "options in the guide's table that the worker does not take"


def test_the_fastapi_recipe_installs_what_the_example_imports() -> None:
    section = GUIDE.read_text().split("**FastAPI.**", 1)[1].split("\n**", 1)[0]
    installs = {
        word.split("[")[0].split(">")[0].split("=")[0].lower()
        for line in section.splitlines()
        if line.startswith("pip install ")
        for word in line.removeprefix("pip install ").split()
    }
    example = ast.parse((ROOT / "examples" / "fastapi_app.py").read_text())
    imported = {
        (node.module or "").split(".")[0]
        for node in ast.walk(example)
        if isinstance(node, ast.ImportFrom) and node.level == 0
    } | {
        alias.name.split(".")[0]
        for node in ast.walk(example)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    ours = {"broker_svc", "control", "worker", "examples", "__future__"}
    # What the example imports beyond the standard library and Clockwork (pydantic comes with
    # FastAPI), and the server the recipe runs it with.
    needed = {name for name in imported - ours if name not in sys.stdlib_module_names} - {"pydantic"}
    assert needed | {"uvicorn"} <= installs, section
