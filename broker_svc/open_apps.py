"""The apps not closed yet: at interpreter exit each is closed, so its outstanding confirms are
waited for and what was not confirmed is said, not lost in silence."""

from __future__ import annotations

import atexit
import weakref
from typing import Protocol

from broker_svc.errors import BrokerSvcError
from broker_svc.logging import get_logger

__all__ = ["open_apps"]

log = get_logger(__name__)


class OpenApp(Protocol):
    """What closing an app at exit needs of it (``App``)."""

    main: str | None

    def close(self) -> None: ...


open_apps: weakref.WeakSet[OpenApp] = weakref.WeakSet()


@atexit.register
def _close_open_apps() -> None:
    for app in list(open_apps):
        try:
            app.close()
        except BrokerSvcError as exc:
            log.error("unconfirmed_at_exit", app=app.main, error=str(exc))
