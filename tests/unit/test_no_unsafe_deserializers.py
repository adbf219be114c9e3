"""S6: no unsafe deserializer anywhere in the packages (an AST walk, so comments and strings don't count).

Flagged: importing pickle, marshal, shelve, jsonpickle or dill; calling eval or exec; yaml.load /
yaml.unsafe_load / yaml.full_load; and msgpack unpackb/unpack/Unpacker without an ``ext_hook`` that
refuses ext types (msgpack's default turns them into ExtType/Timestamp objects nobody asked for).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.reliability.journal import report

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("broker_svc", "control", "worker")
_BANNED_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "jsonpickle", "dill", "cloudpickle"}
_BANNED_CALLS = {"eval", "exec"}
_YAML_LOADS = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all"}
_MSGPACK_DECODERS = {"unpackb", "unpack", "Unpacker"}


def findings_in(source: str, path: str = "<source>") -> list[str]:
    """Every unsafe use in ``source``, as ``path:line: what``."""
    tree = ast.parse(source, filename=path)
    msgpack_names = {"msgpack"}  # `import msgpack as mp` and `from msgpack import unpackb` too
    decoder_names: set[str] = set()
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{path}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _BANNED_MODULES:
                    flag(node, f"import {alias.name}")
                if alias.name == "msgpack":
                    msgpack_names.add(alias.asname or "msgpack")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _BANNED_MODULES:
                flag(node, f"from {node.module} import ...")
            if node.module == "msgpack":
                decoder_names |= {a.asname or a.name for a in node.names if a.name in _MSGPACK_DECODERS}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in _BANNED_CALLS:
            flag(node, f"{func.id}()")
        owner, attr = _dotted(func)
        if owner == "yaml" and attr in _YAML_LOADS:
            flag(node, f"yaml.{attr}()")
        decoder = (owner in msgpack_names and attr in _MSGPACK_DECODERS) or (
            isinstance(func, ast.Name) and func.id in decoder_names
        )
        if decoder and not _refuses_ext(node):
            flag(node, f"msgpack {ast.unparse(func)}() without an ext_hook that refuses ext types")
    return found


def _dotted(func: ast.expr) -> tuple[str | None, str | None]:
    """``("yaml", "load")`` for ``yaml.load``; ``(None, None)`` for anything else."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id, func.attr
    return None, None


def _refuses_ext(call: ast.Call) -> bool:
    hook = next((k.value for k in call.keywords if k.arg == "ext_hook"), None)
    # msgpack.ExtType (the default) accepts them; anything else is a hook of ours.
    return hook is not None and not (isinstance(hook, ast.Attribute) and hook.attr == "ExtType")


def test_no_package_module_uses_an_unsafe_deserializer():
    found: list[str] = []
    files = 0
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files += 1
            found += findings_in(path.read_text(), str(path.relative_to(ROOT)))
    report("S6", None, found=len(found), files=files, where=found)
    assert found == []


def test_the_checker_finds_each_kind_of_unsafe_use():
    sample = """
import pickle
import msgpack as mp
from marshal import loads
from msgpack import unpackb as ub
import yaml
eval("1")
exec("x = 1")
yaml.load(data)
yaml.unsafe_load(data)
mp.unpackb(b"")
mp.Unpacker(ext_hook=mp.ExtType)
ub(b"")
mp.unpackb(b"", ext_hook=refuse)
yaml.safe_load(data)
"""
    found = findings_in(sample)
    assert len(found) == 9, found
    assert not any(":14:" in f or ":15:" in f for f in found)  # the guarded and safe calls pass
