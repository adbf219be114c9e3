"""Signatures of Celery's built-in tasks that take one task and many items: ``task.map(it)``,
``task.starmap(it)`` and ``task.chunks(it, n)`` (a group of starmaps)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker_svc.canvas.signature import Signature, group

if TYPE_CHECKING:
    from broker_svc.results.result import GroupResult

__all__ = ["chunks", "xmap", "xstarmap"]


class xmap(Signature):
    """``task.map(it)``: one task that calls ``task(item)`` for each item (Celery's ``celery.map``)."""

    task_name = "celery.map"

    def __init__(self, task: Signature, it: Iterable[Any], **options: Any) -> None:
        super().__init__(
            self.task_name, (), {"task": task.as_wire(), "it": list(it)}, options, immutable=True,
            app=task._app,
        )  # fmt: skip


class xstarmap(xmap):
    """``task.starmap(it)``: one task that calls ``task(*item)`` for each item (``celery.starmap``)."""

    task_name = "celery.starmap"


class chunks(Signature):
    """``task.chunks(it, n)``: the items in parts of ``n``, each part one ``starmap`` task, as a group."""

    def __init__(self, task: Signature, it: Iterable[Any], n: int, **options: Any) -> None:
        if n < 1:
            raise ValueError(f"chunk size must be at least 1, got {n}")
        super().__init__(
            "celery.chunks", (), {"task": task.as_wire(), "it": list(it), "n": n}, options, immutable=True,
            app=task._app,
        )  # fmt: skip
        self._task = task

    def group(self) -> group:
        """The group of ``starmap`` tasks this sends."""
        items, n = self.kwargs["it"], int(self.kwargs["n"])
        parts = [items[i : i + n] for i in range(0, len(items), n)]
        return group((xstarmap(self._task, part) for part in parts), app=self._app)

    def apply_async(
        self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None, **options: Any
    ) -> GroupResult:
        return self.group().apply_async(**{**self.options, **options})
