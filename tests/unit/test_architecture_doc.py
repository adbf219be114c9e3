"""docs/architecture.md stays true to the code: it names every module, and every path and
``path.py:function`` it names exists."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("broker_svc", "control", "worker")
# `broker_svc/wire/codec.py` or `worker/consume/consumer.py:TaskConsumer.on_message`
_REFERENCE = re.compile(r"`((?:broker_svc|control|worker)/[\w/]+\.py)(?::([\w.]+))?`")


def _modules() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py"
    }


def _defined(path: pathlib.Path) -> set[str]:
    """Dotted names defined in a module: functions, classes, their methods, module-level names."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(f"{node.name}.{item.name}")
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def references(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in _REFERENCE.finditer(text)]


def broken(text: str) -> list[str]:
    """What the text names that the code does not have."""
    wrong = []
    for path, name in references(text):
        file = ROOT / path
        if not file.is_file():
            wrong.append(path)
        elif name is not None and name not in _defined(file):
            wrong.append(f"{path}:{name}")
    return wrong


def test_the_map_names_every_module_of_the_packages():
    named = {path for path, _ in references(DOC.read_text())}
    assert sorted(_modules() - named) == []


def test_every_path_and_function_the_page_names_exists():
    assert broken(DOC.read_text()) == []


def test_the_checker_reports_a_missing_module_and_a_missing_function():
    text = "`worker/nowhere.py` and `worker/service.py:no_such_function` and `worker/service.py`"
    assert broken(text) == ["worker/nowhere.py", "worker/service.py:no_such_function"]
