"""The packages' layout holds: no import cycle, and each of the worker's folders imports only what
its process may.

Counted as a reader meets them: imports at module level, inside functions and under
``TYPE_CHECKING`` alike (a cycle hidden in a function is still a cycle to whoever reads the code).
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A pool child's folders: blocking, on the child's own socket; never the main process's parts.
CHILD_FOLDERS = ("worker/child/", "worker/consume/", "worker/rules/", "worker/shared/")
MAIN_ONLY = ("worker.pool", "worker.amqp", "worker.remote", "worker.single_active", "worker.service")
IO_LIBRARIES = {"pika", "aio_pika", "aiormq", "pamqp", "socket", "asyncio", "selectors", "mmap"}


def _modules(package: str) -> dict[str, pathlib.Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(path: pathlib.Path) -> Iterator[str]:
    # Every module an import statement names, wherever the statement stands.
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        named = set(_imported(path))
        # ``from worker.pool import feeding`` imports the module, not the package's exports.
        graph[name] = {
            target
            for target in named & modules.keys()
            if target != name and not any(other.startswith(f"{target}.") for other in named & modules.keys())
        }
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_checker_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_the_worker_has_no_import_cycle():
    assert strongly_connected(_graph("worker")) == []


def test_the_client_library_and_the_control_plane_have_no_import_cycle():
    # Types count too: a module annotates with a Protocol (``broker_svc/tasks/task_app.py``), not with
    # the class of a module that imports it back.
    assert strongly_connected(_graph("broker_svc")) == []
    assert strongly_connected(_graph("control")) == []


def test_a_childs_folders_never_import_the_main_processs_parts_or_aio_pika():
    checked = 0
    for path in _modules("worker").values():
        relative = str(path.relative_to(ROOT))
        if not relative.startswith(CHILD_FOLDERS):
            continue
        for target in _imported(path):
            assert not target.startswith(MAIN_ONLY), f"{relative} imports {target}"
            assert target.split(".")[0] not in {"aio_pika", "aiormq", "pamqp", "pika", "control"}, relative
        checked += 1
    assert checked >= 25  # the folders exist and hold the child's modules


def test_the_rules_do_no_io():
    rules = [path for path in (ROOT / "worker" / "rules").glob("*.py") if path.name != "__init__.py"]
    assert len(rules) >= 5
    for path in rules:
        tops = {target.split(".")[0] for target in _imported(path)}
        assert not tops & IO_LIBRARIES, path
