"""Pins ``control``'s public names (STYLE rules 5 and 6) and that importing them stays lazy."""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import subprocess
import sys
import typing

import pytest

import control
from control.api import Inspect

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_control_exports_exactly_its_public_names():
    assert sorted(control.__all__) == sorted(
        [
            "Control", "Inspect",
            "BroadcastResult", "ControlClient", "InspectReply", "RevokeResult",
            "DeadLetters",
            "Membership", "ReplyCollector",
        ]
    )  # fmt: skip


@pytest.mark.parametrize("name", control.__all__)
def test_each_export_resolves_to_the_object_its_module_defines(name):
    module = control._EXPORTS[name]
    value = getattr(control, name)
    assert value is getattr(importlib.import_module(module), name)
    assert value.__module__ == module  # the module that defines it, not one that re-exports it


def test_the_lazy_map_and_the_type_checking_imports_name_the_same_modules():
    # mypy reads the TYPE_CHECKING block, the runtime reads _EXPORTS: they must agree.
    tree = ast.parse((ROOT / "control" / "__init__.py").read_text())
    [guard] = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imports = [node for node in guard.body if isinstance(node, ast.ImportFrom)]
    typed = {alias.name: node.module for node in imports for alias in node.names}
    assert typed == control._EXPORTS
    assert set(typed) == set(control.__all__)


def _loaded_after(statement: str) -> set[str]:
    """The AMQP clients and control modules a fresh interpreter holds after ``statement``."""
    watched = ("pika", "aio_pika", "aiormq", "control.blocking", "control.aio", "control.api")
    listing = f"[m for m in sys.modules if m.startswith({watched!r})]"
    probe = f"import json, sys; {statement}; print(json.dumps({listing}))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout))


def test_importing_control_loads_no_amqp_client():
    assert _loaded_after("import control") == set()


def test_the_pure_exports_load_without_pika():
    pure = "BroadcastResult, InspectReply, Membership, ReplyCollector, RevokeResult"
    assert _loaded_after(f"from control import {pure}") == set()


def test_the_mailbox_node_loads_aio_pika_but_not_the_blocking_client():
    loaded = _loaded_after("import control.aio.node")
    assert {"aio_pika", "control.aio.node"} <= loaded  # the probe does see what is imported
    blocking = ("pika.", "control.blocking", "control.api")
    assert not {m for m in loaded if m == "pika" or m.startswith(blocking)}


def test_control_sub_packages_hold_only_a_docstring():
    for init in sorted((ROOT / "control").glob("*/__init__.py")):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), init
        assert isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str), init


def test_every_inspect_query_names_the_shape_of_its_reply():
    queries = [name for name, value in vars(Inspect).items() if not name.startswith("_") and callable(value)]
    assert {"ping", "active", "stats", "query_task", "conf"} <= set(queries)
    for name in queries:
        returned = typing.get_type_hints(getattr(Inspect, name))["return"]
        assert returned is not typing.Any, name
        assert type(None) in typing.get_args(returned), name  # None: no node replied
