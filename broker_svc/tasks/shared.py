"""``shared_task`` and the current app: tasks defined without an app, as in reusable Celery apps.

A ``@shared_task`` function is registered on every ``App``, those that exist when it is defined
and those made later. What the decorator returns is a proxy for the task on the *current* app (the
last one made with ``set_as_current=True``, Celery's default: ``broker_svc/tasks/task_app.py``), so
``add.delay(2, 2)`` in a module that never imports the app sends through the app the program made.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, Literal, cast, overload

from typing_extensions import ParamSpec, TypeVar

from broker_svc.tasks.registry import TaskRegistry
from broker_svc.tasks.task import Task
from broker_svc.tasks.task_app import current_app

if TYPE_CHECKING:
    from broker_svc.canvas.signature import Signature
    from broker_svc.results.result import AsyncResult

__all__ = ["SharedTask", "app_created", "current_app", "shared_task"]

_lock = threading.Lock()
# Every shared task defined so far: (function, base, options, name).
_defined: list[tuple[Callable[..., Any], type[Task] | None, dict[str, Any], str]] = []
_apps: weakref.WeakSet[TaskRegistry] = weakref.WeakSet()


def app_created(app: TaskRegistry) -> None:
    """Register every shared task on a new app (called by ``App.__init__``)."""
    with _lock:
        _apps.add(app)
        defined = list(_defined)
    for fn, base, options, name in defined:
        _register(app, fn, base, options, name)


P = ParamSpec("P", default=...)
R = TypeVar("R", default=Any)
_P = ParamSpec("_P")
_R = TypeVar("_R")


class SharedTask(Generic[P, R]):
    """Stands for a shared task on the current app: every attribute and call goes to that task.

    Typed as the task is (``Task[P, R]``): ``delay``, ``si`` and calls are checked against the
    function's parameters.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def _task(self) -> Task[P, R]:
        # The registry holds tasks of every signature; this one is the function's (shared_task).
        return cast("Task[P, R]", current_app().tasks[self.name])

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._task(), attribute)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._task()(*args, **kwargs)

    def delay(self, *args: P.args, **kwargs: P.kwargs) -> AsyncResult[R]:
        """``Task.delay`` on the current app's task."""
        return self._task().delay(*args, **kwargs)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> AsyncResult[R]:
        """``Task.apply_async`` on the current app's task."""
        return self._task().apply_async(args, kwargs, **options)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """``Task.s`` (a partial) on the current app's task."""
        return self._task().s(*args, **kwargs)

    def si(self, *args: P.args, **kwargs: P.kwargs) -> Signature:
        """``Task.si`` on the current app's task."""
        return self._task().si(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<@shared_task: {self.name}>"


@overload
def shared_task(fn: Callable[_P, _R], /) -> SharedTask[_P, _R]: ...


@overload
def shared_task(
    fn: None = None, /, *, bind: Literal[True], base: type[Task] | None = None, **options: Any
) -> Callable[[Callable[Concatenate[Any, _P], _R]], SharedTask[_P, _R]]: ...


@overload
def shared_task(
    fn: None = None, /, *, base: type[Task] | None = None, **options: Any
) -> Callable[[Callable[_P, _R]], SharedTask[_P, _R]]: ...


def shared_task(
    fn: Callable[..., Any] | None = None, /, *, base: type[Task] | None = None, **options: Any
) -> SharedTask | Callable[[Callable[..., Any]], SharedTask]:
    """Define a task for every app: ``@shared_task`` or ``@shared_task(bind=True, ...)``.

    Its name is ``<module>.<function>`` unless ``name=`` is given. Options are those of ``app.task``.

    Raises:
        TypeError: an unknown option (raised when an app registers it).
    """

    def define(func: Callable[..., Any]) -> SharedTask:
        name = options.get("name") or f"{func.__module__}.{func.__name__}"
        with _lock:
            _defined.append((func, base, dict(options), name))
            apps = list(_apps)
        for app in apps:
            _register(app, func, base, options, name)
        return SharedTask(name)

    return define(fn) if fn is not None else define


def _register(
    app: TaskRegistry, fn: Callable[..., Any], base: type[Task] | None, options: dict[str, Any], name: str
) -> None:
    app._register(fn, base=base or Task, options=dict(options), shared_name=name)
