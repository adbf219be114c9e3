"""``TaskApp``: what tasks, signatures and canvases use of the app that sends them, and the current app.

``Task.app``, ``Signature.app`` and ``current_app()`` are typed by this Protocol rather than by
``App``: ``App`` is built from tasks, signatures and results, so a module of theirs that named
``App`` would import its own importer. An ``App`` is a ``TaskApp`` (``tests/unit/test_task_app.py``
assigns one, so mypy checks it). ``Task`` and ``Signature`` name this Protocol in turn, so it cannot
name them: the tasks it holds and the signatures it takes are ``Any`` here; ``App`` itself types
them (``App.tasks`` is a ``dict[str, Task]``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from broker_svc.apps import open_apps
from broker_svc.errors import ConfigurationError

if TYPE_CHECKING:
    from broker_svc.apps.conf import Config
    from broker_svc.apps.control_plane import ControlPlane
    from broker_svc.results.backend import ResultBackend
    from broker_svc.results.result import AsyncResult as ResultHandle
    from broker_svc.settings import Settings
    from broker_svc.topology import QueueSpec
    from broker_svc.wire.task.task_message import WireMessage

__all__ = ["TaskApp", "current_app", "set_current_app"]


class TaskApp(Protocol):
    """The app a task or signature is sent through (an ``App``), as its code sees it (``self.app``)."""

    @property
    def main(self) -> str | None: ...

    @property
    def conf(self) -> Config: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def tasks(self) -> Mapping[str, Any]:
        """The registered tasks by name (each a ``Task``)."""
        ...

    @property
    def reply_queue(self) -> str: ...

    @property
    def control(self) -> ControlPlane: ...

    def get_task(self, name: str) -> Any:
        """The registered ``Task`` of this name; ``NotRegistered`` if there is none."""
        ...

    def send_task(
        self,
        name: str,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> ResultHandle: ...

    def send_many(self, signatures: Iterable[Any], *, wait: bool = False) -> list[ResultHandle]:
        """Send these ``Signature``s in one hand-over to the connection."""
        ...

    def AsyncResult(self, task_id: str) -> ResultHandle: ...

    @property
    def backend(self) -> ResultBackend: ...

    def publish_confirmed(self, queue: QueueSpec, message: WireMessage) -> None:
        """Publish a message that is not a task to ``queue`` and wait for its confirm."""
        ...


def current_app() -> TaskApp:
    """The app ``shared_task`` proxies and app-less signatures use: the last one made with
    ``set_as_current=True`` (or ``app.set_current()``; ``broker_svc/apps/open_apps.py``).

    Raises:
        ConfigurationError: no app has been made.
    """
    app = open_apps.current()
    if app is None:
        raise ConfigurationError("no App has been created: shared tasks need one (app = App('proj'))")
    return cast("TaskApp", app)  # only set_current_app makes an app current: it takes a TaskApp


def set_current_app(app: TaskApp) -> None:
    """Make ``app`` the current app (``App.__init__`` and ``App.set_current`` call this)."""
    open_apps.set_current(app)
