"""The modules that hold an app's tasks: ``imports``, ``include`` and ``autodiscover_tasks``.

A worker imports them when it loads the app (``App.import_task_modules``), so the tasks they
define are registered before the first delivery.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["Discovery", "import_task_modules"]

# ``autodiscover_tasks(packages, related_name)``: the packages (or a callable giving them) and the
# module name to look for in each.
Discovery = tuple[Iterable[str] | Callable[[], Iterable[str]], str]


def import_task_modules(conf: Mapping[str, Any], discoveries: Iterable[Discovery]) -> list[str]:
    """Import the modules ``conf``'s ``imports``/``include`` name and ``discoveries`` find; their names.

    A package without the related module is skipped, as in Celery.

    Raises:
        ImportError: a module named by ``imports`` or ``include`` does not import, or a found
            module's own import fails.
    """
    names: list[str] = []
    for key in ("imports", "include"):
        value = conf.get(key) or ()
        names.extend([value] if isinstance(value, str) else value)
    for packages, related_name in discoveries:
        listed = packages() if callable(packages) else packages
        for package in listed:
            candidate = f"{package}.{related_name}"
            try:
                importlib.import_module(candidate)
            except ModuleNotFoundError as exc:
                if exc.name not in (candidate, package):
                    raise  # the module exists but one of its own imports is missing
                continue
            names.append(candidate)
    for name in names:
        importlib.import_module(name)
    return list(dict.fromkeys(names))
