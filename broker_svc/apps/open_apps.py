"""The apps of this process: those not closed yet, and the current one.

At interpreter exit each app not closed yet is closed, so its outstanding confirms are waited
for and what was not confirmed is said, not lost in silence. The current app is the last one made
with ``set_as_current=True`` (Celery's default) or made current with ``app.set_current()``: what
app-less code reads as Celery's ``current_app`` (shared tasks, app-less signatures,
``GroupResult.restore(id)``, ``AsyncResult(id)``); ``broker_svc/tasks/task_app.py`` types it.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

from broker_svc.errors import BrokerSvcError
from broker_svc.logging import get_logger

__all__ = ["current", "open_apps", "set_current"]

log = get_logger(__name__)


class OpenApp(Protocol):
    """What closing an app at exit needs of it (``App``)."""

    main: str | None

    def close(self) -> None: ...


open_apps: weakref.WeakSet[OpenApp] = weakref.WeakSet()
# The current app, weakly, so a dropped app goes (Celery's is a thread-local default; ours is one
# per process, as apps are made at import time).
_current: weakref.ReferenceType[object] | None = None


def current() -> object | None:
    """The current app (an ``App``; typed by ``task_app.current_app``), or None before any."""
    return _current() if _current is not None else None


def set_current(app: object) -> None:
    """Make ``app`` the current app (``App.__init__`` and ``App.set_current`` call this)."""
    global _current
    _current = weakref.ref(app)


@atexit.register
def _close_open_apps() -> None:
    for app in list(open_apps):
        try:
            app.close()
        except BrokerSvcError as exc:
            log.error("unconfirmed_at_exit", app=app.main, error=str(exc))
