"""Find the user's ``App`` from an ``-A package.module:attr`` spec."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Final

from broker_svc.app import App
from broker_svc.errors import ConfigurationError

__all__ = [
    "APP_PATH_ENV",
    "FORKSERVER_ENV",
    "SAFE_PATH_ADDED_ENV",
    "AppImportFailed",
    "AppNotFound",
    "BadAppSpec",
    "NotAnApp",
    "extend_path_from_environment",
    "load_app",
    "split_spec",
    "use_current_directory",
]

DEFAULT_ATTRIBUTE: Final = "app"


class BadAppSpec(ValueError):
    """An ``-A`` spec that is not ``package.module:attribute``."""


class AppNotFound(ImportError):
    """The module or attribute an ``-A`` spec names cannot be found (not an error inside the module)."""


class AppImportFailed(ImportError):
    """The module of an ``-A`` spec does not compile, or its ``App(...)`` refused its configuration."""


class NotAnApp(ValueError):
    """The ``-A`` spec names something that is not a ``broker_svc.App``."""


# Where the pool children find the user's modules (``use_current_directory``; worker.child.run).
APP_PATH_ENV: Final = "CLOCKWORK_APP_PATH"


def use_current_directory() -> None:
    """Let ``-A`` name a module in the current directory, as ``celery -A`` does.

    ``python -m worker`` has the current directory on ``sys.path``; the installed
    ``clockwork-worker`` script has its own directory there instead. The directory goes *last*, so
    a module of the user's named like one of ours (``worker.py``) does not replace it; the pool
    children get it through ``CLOCKWORK_APP_PATH`` (not ``PYTHONPATH``, which comes before the
    installed packages).
    """
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    os.environ[APP_PATH_ENV] = cwd


# Set when the pool added PYTHONSAFEPATH for its forkserver only (worker.pool.pool).
SAFE_PATH_ADDED_ENV: Final = "CLOCKWORK_SAFE_PATH_ADDED"
# Set while the pool starts its forkserver: the process that preloads the app the worker has
# already loaded (and logged about) once (worker.child.main).
FORKSERVER_ENV: Final = "CLOCKWORK_FORKSERVER"


def extend_path_from_environment() -> None:
    """In a pool child: put the worker's ``CLOCKWORK_APP_PATH`` last on ``sys.path``."""
    path = os.environ.get(APP_PATH_ENV)
    if path and path not in sys.path:
        sys.path.append(path)


def split_spec(spec: str) -> tuple[str, str]:
    """Split ``"package.module:attr"`` (or ``"package.module"``, meaning attribute ``app``).

    Raises:
        ValueError: the spec is empty or malformed.
    """
    module, colon, attribute = spec.strip().partition(":")
    if not colon:
        attribute = DEFAULT_ATTRIBUTE
    # An empty part ("pkg.mod:") is a typo, not a request for the default attribute.
    if not _is_dotted_name(module) or not _is_dotted_name(attribute):
        raise BadAppSpec(
            f"bad app spec {spec!r}: use 'package.module:attribute' (e.g. 'proj.tasks:app'), "
            f"or 'package.module' for an attribute named {DEFAULT_ATTRIBUTE!r}"
        )
    return module, attribute


def load_app(spec: str) -> App:
    """Import the module of ``spec`` and return its ``App``, with the modules it includes imported.

    Raises:
        ValueError: the spec is malformed, or the attribute is not a ``broker_svc.App``.
        ImportError: the module cannot be imported (``AppImportFailed``: a syntax error, or a
            configuration our ``App`` refused), or has no such attribute.
        Exception: whatever else the module itself raises while it is imported (left as it is, so
            the traceback points at the user's line).
    """
    module_name, attribute = split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        # Python's own report is ~20 lines of importlib frames around one fact: where the typo is.
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else module_name
        code = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        raise AppImportFailed(
            f"cannot load app {spec!r}: {type(exc).__name__} in {where}: {exc.msg}{code}", name=module_name
        ) from exc
    except ConfigurationError as exc:
        # Our App(...) refused a setting (an unsupported backend, say): its message says what to
        # change; the user's line that set it is all the traceback would add.
        raise AppImportFailed(f"cannot load app {spec!r}: {exc}{_user_line(exc)}", name=module_name) from exc
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise AppNotFound(
                f"cannot load app {spec!r}: no module named {exc.name!r}; check the spelling, and that "
                f"the directory holding it is the current directory or on PYTHONPATH",
                name=module_name,
            ) from exc
        # The module exists but one of its own imports is missing: say so instead of blaming the spec.
        raise AppNotFound(
            f"cannot load app {spec!r}: importing {module_name!r} failed: {exc}; is a dependency missing?",
            name=module_name,
        ) from exc
    value: object = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            candidates = sorted(name for name, obj in vars(module).items() if isinstance(obj, App))
            hint = (
                f"; App objects in it: {', '.join(f'{module_name}:{n}' for n in candidates)}"
                if candidates
                else f"; define one there, e.g. {DEFAULT_ATTRIBUTE} = App({module_name!r})"
            )
            raise AppNotFound(
                f"cannot load app {spec!r}: module {module_name!r} has no attribute {attribute!r}{hint}",
                name=module_name,
            ) from None
    if not isinstance(value, App):
        raise NotAnApp(
            f"app spec {spec!r} names a {type(value).__name__}, not a broker_svc.App; "
            f"point it at the App instance your tasks are registered on (e.g. 'proj.tasks:app')"
        )
    # The modules the app names (include=, imports, autodiscover_tasks) hold tasks too.
    value.import_task_modules()
    return value


def _user_line(exc: BaseException) -> str:
    # The innermost frame outside Clockwork's packages and importlib: the user's line that raised it.
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith((*_OUR_PACKAGES, "<frozen ")) and f.filename != importlib.__file__
    ]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


_OUR_PACKAGES: Final = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), package) + os.sep
    for package in ("broker_svc", "control", "worker")
)


def _is_dotted_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))
