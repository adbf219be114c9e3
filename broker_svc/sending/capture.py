"""Sends kept instead of published: how the asyncio client reuses the blocking canvas as it is.

``chain``, ``group`` and ``chord`` build their messages by calling their app (``send_task``,
``send_many``, ``AsyncResult``, ``reply_queue``). Inside ``with capturing(reply_queue) as capture:``
an ``App`` hands every signature it would send to ``capture`` instead, with the task id it will
have, and answers with placeholder results; the asyncio client then publishes what was kept,
with the same ``build_message`` the blocking client uses, so both send exactly the same tasks.
The block holds no await: a context variable is enough to keep other coroutines out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

from broker_svc.canvas.signature import Signature
from broker_svc.results.result import AsyncResult
from broker_svc.results.store import ResultStore
from broker_svc.wire.ids import uuid4_str

__all__ = ["SendCapture", "capturing", "current_capture"]


class SendCapture:
    """The signatures apps were asked to send while it was open, each with its task id.

    Args:
        reply_queue: the reply queue the kept tasks answer to (the asyncio client's).
    """

    def __init__(self, reply_queue: str) -> None:
        self.reply_queue = reply_queue
        self.kept: list[Signature] = []
        # Placeholder handles only: the asyncio client makes its own results from their ids.
        self.store = ResultStore(accept=frozenset({"application/json"}), max_bytes=0)

    def keep(self, signatures: Sequence[Signature]) -> list[AsyncResult]:
        """Keep ``signatures`` (a copy each, with its task id fixed); a placeholder result each."""
        handles: list[AsyncResult] = []
        for sig in signatures:
            task_id = sig.options.get("task_id") or uuid4_str()
            self.kept.append(Signature(sig.task, sig.args, sig.kwargs, {**sig.options, "task_id": task_id}))
            handles.append(AsyncResult(task_id, store=self.store))
        return handles

    def result(self, task_id: str) -> AsyncResult:
        """A placeholder result for ``task_id`` (what ``App.AsyncResult`` answers while capturing)."""
        return AsyncResult(task_id, store=self.store)


_current: ContextVar[SendCapture | None] = ContextVar("clockwork_send_capture", default=None)


def current_capture() -> SendCapture | None:
    """The capture open in this context, if any (``App`` checks it before sending)."""
    return _current.get()


@contextmanager
def capturing(reply_queue: str) -> Iterator[SendCapture]:
    """Keep what every app is asked to send inside the block, instead of sending it."""
    capture = SendCapture(reply_queue)
    token = _current.set(capture)
    try:
        yield capture
    finally:
        _current.reset(token)
