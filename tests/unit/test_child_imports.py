"""A pool child starts lean: what the forkserver preloads (and every child shares) leaves out the
modules only a few requests use.

``importlib.metadata`` (with the email, zipfile and csv packages it imports) is 3 MiB of each
worker's idle memory that only ``inspect report`` and ``app.control`` need; BENCHMARKS.md's idle
PSS row is what it cost.
"""

from __future__ import annotations

from tests.support.imports import heavy, loaded_after

NEVER_PRELOADED = ("importlib.metadata", "email", "zipfile", "csv", "tomllib", "pika", "aio_pika")


def test_the_childrens_preload_imports_no_module_a_task_path_never_uses() -> None:
    loaded = loaded_after("import worker.child.main")
    assert heavy(loaded, NEVER_PRELOADED) == []
