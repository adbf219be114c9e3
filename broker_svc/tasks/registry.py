"""``TaskRegistry``: the App's registry of tasks: ``@app.task``, their names, ``get_task``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Literal, overload

from typing_extensions import ParamSpec, TypeVar

from broker_svc.errors import NotRegistered
from broker_svc.tasks.task import Task as TaskBase
from broker_svc.tasks.task_class import build_task_class, check_task_class

__all__ = ["TaskRegistry"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class TaskRegistry:
    """The tasks of an app by name, and the ``task`` decorator that registers them (``App``'s base)."""

    main: str | None
    tasks: dict[str, TaskBase]

    # The overloads give type checkers the function's parameters and result (``Task[P, R]``), so
    # ``add.delay(1, "x")`` is an error for ``def add(x: int, y: int)``; with ``bind=True`` the
    # first parameter (the task itself) is not one the caller passes.
    @overload
    def task(self, fn: Callable[_P, _R], /) -> TaskBase[_P, _R]: ...

    @overload
    def task(
        self, fn: None = None, /, *, bind: Literal[True], base: type[TaskBase] = TaskBase, **options: Any
    ) -> Callable[[Callable[Concatenate[Any, _P], _R]], TaskBase[_P, _R]]: ...

    @overload
    def task(
        self, fn: None = None, /, *, base: type[TaskBase] = TaskBase, **options: Any
    ) -> Callable[[Callable[_P, _R]], TaskBase[_P, _R]]: ...

    def task(
        self, fn: Callable[..., Any] | None = None, /, *, base: type[TaskBase] = TaskBase, **options: Any
    ) -> TaskBase | Callable[[Callable[..., Any]], TaskBase]:
        """Register a function as a task: ``@app.task`` or ``@app.task(name=..., bind=True, ...)``.

        Keyed deduplication: ``@app.task(dedup_key="user_id")`` lets one call per key run at a
        time, cluster-wide, keeps at most one more waiting, and declines the rest: their
        ``get()`` raises ``TaskDeclined`` and their state is ``DECLINED``; they never run.
        ``dedup_key`` is the name of one of the function's arguments, bound as the function
        binds it (``refresh(42)`` and ``refresh(user_id=42)`` have the same key; a default
        counts), or a callable taking the task's ``(*args, **kwargs)`` and returning the key.
        The key is ``"<task name>:<value>"`` (the value's ``str()``), so two tasks with equal
        arguments do not share keys; it must fit in 200 UTF-8 bytes. ``dedup_timeout``
        (seconds, 0 < t <= 1500, default 600) bounds how long a run holds its key: it is also
        the run's hard time limit, and past it the waiting call is sent on. A send's own
        ``dedup_key=`` (``apply_async``, ``send_task``) is a literal
        key that replaces the task's. Only tasks a client sends are deduplicated, to a queue
        (not ``exchange=``), and only by Clockwork workers; a chord's header tasks and tasks a
        worker sends later (callbacks, errbacks, a chain's steps after the first, a chord's
        body) cannot have keys (a ``TypeError`` when the canvas is sent), nor can ``depends_on``
        jobs and beat entries. Eager mode ignores keys, as it ignores routing.

        Raises:
            TypeError: an unknown option or a bad ``base``; a ``dedup_key`` that is neither one
                of the function's arguments nor a callable.
            ValueError: another task already has this name; a ``dedup_timeout`` out of range.
        """

        def register(func: Callable[..., Any]) -> TaskBase:
            return self._register(func, base=base, options=dict(options))

        return register(fn) if fn is not None else register

    def _register(
        self,
        func: Callable[..., Any],
        *,
        base: type[TaskBase],
        options: dict[str, Any],
        shared_name: str | None = None,
    ) -> TaskBase:
        name = options.pop("name", None) or shared_name or self._default_name(func)
        existing = self.tasks.get(name)
        if existing is not None and shared_name is not None:
            if getattr(type(existing), "__wrapped__", None) is func:
                return existing  # the same shared task, offered again
        cls = build_task_class(self, func, name=name, base=base, options=options)
        if existing is not None:
            raise ValueError(f"a task named {name!r} is already registered; pass name= to rename")
        instance = cls()
        self.tasks[name] = instance
        return instance

    def register_task(self, task: TaskBase | type[TaskBase], **options: Any) -> TaskBase:
        """Register a class-based task, as Celery's ``app.register_task`` (``class T(app.Task)``).

        ``task`` is an instance (or its class, made with no arguments). Its class attributes are its
        options, as with ``@app.task(...)``; ``options`` set more on this instance (Celery passes
        ``autoretry_for``, ``retry_kwargs``, ``retry_backoff``, ... this way). A task without a
        ``name`` is named ``<module>.<ClassName>``. A class of ``app.Task`` sends through that app
        (``T().delay()``); one of plain ``broker_svc.Task`` is bound to this one. A worker runs the
        instance registered here: register it in a module the worker imports (the ``-A`` app
        module or one it ``include``s).

        Returns:
            The task registered: ``task``, or the instance of its class registered before.

        Raises:
            TypeError: ``task`` is not a ``broker_svc.Task`` (or subclass), an unknown option, or a
                ``dedup_key`` that is neither one of ``run``'s arguments nor a callable.
            ValueError: another task already has its name; a ``rate_limit`` that is not a rate; a
                ``dedup_timeout`` out of range.
        """
        if isinstance(task, type) and issubclass(task, TaskBase):
            task = task()
        if not isinstance(task, TaskBase):
            raise TypeError(f"register_task() takes a broker_svc.Task instance or subclass, got {task!r}")
        cls = type(task)
        unknown = set(options) - cls.OPTIONS
        if unknown:
            raise TypeError(f"unknown task option(s) {sorted(unknown)}; known: {sorted(cls.OPTIONS)}")
        for option, value in options.items():
            setattr(task, option, value)  # on this instance, as Celery's add_autoretry_behaviour
        if not task.name:
            cls.name = self._default_name(cls)  # on the class: ``T().delay()`` has it too
        existing = self.tasks.get(task.name)
        if existing is not None:
            if existing is task or type(existing) is cls:
                return existing  # the module imported twice, or the class registered again
            raise ValueError(f"a task named {task.name!r} is already registered; give it another name")
        checked = check_task_class(task, self)
        self.tasks[task.name] = checked
        return checked

    def _default_name(self, fn: Callable[..., Any] | type) -> str:
        module = fn.__module__
        if module == "__main__" and self.main:
            module = self.main
        return f"{module}.{fn.__name__}"

    def get_task(self, name: str) -> TaskBase:
        """The registered task of this name.

        Raises:
            NotRegistered: no such task.
        """
        try:
            return self.tasks[name]
        except KeyError:
            raise NotRegistered(name) from None
