"""A package ``__getattr__`` that imports an exported name's module on first use (PEP 562).

For packages whose exports pull in heavy libraries that not every importer needs: the worker's pool
children import ``worker.child.main``, which runs ``worker/__init__.py``; with its exports loaded
eagerly, each child would carry aio-pika, the control plane and pika it never uses.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` for ``package``: ``exports`` maps each lazy name to its module."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # found directly from now on
        return value

    return __getattr__
