"""How the worker starts and reaps a pool child; both block (on the forkserver or the process)."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import threading
from multiprocessing import resource_tracker
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Final

from broker_svc.errors import BrokerSvcError, DecodeError, MessageTooLarge
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.main import main

if TYPE_CHECKING:
    from worker.child.spec import FeedSpec

__all__ = ["PoolStartError", "go_without_resource_tracker", "reap", "spawn"]

# multiprocessing's table of children is process-wide, and Process.start() polls every child in
# it. Reading a forkserver child's exit status consumes it from its sentinel pipe, so two threads
# polling the same child at once would make one of them see 255; this lock keeps them apart.
_PROCESS_TABLE: Final = threading.Lock()


class PoolStartError(BrokerSvcError, RuntimeError):
    """A pool child could not start: the app did not load in it, or it did not report ready in time."""


def go_without_resource_tracker() -> None:
    """Keep multiprocessing from starting its resource tracker process (before the forkserver starts).

    The forkserver starts the stdlib's tracker, a whole interpreter (about 7 MiB of PSS, a tenth of
    an idle worker), to unlink named semaphores and shared memory that a dead process leaked. The
    pool creates neither (its shared state is ``worker/shared/shared_file.py``'s own files). So the
    tracker's pipe is ``/dev/null``: it always looks alive, and what task code registers there (a
    ``multiprocessing`` lock, say) is not cleaned up after a crash, as under Celery, which has no
    tracker either. A tracker that already runs (started by someone else) is left alone.
    """
    tracker: Any = resource_tracker._resource_tracker  # typeshed leaves out the private fd
    if tracker._fd is None:
        tracker._fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)


def spawn(
    context: ForkServerContext, app_spec: str, *, timeout_s: float, feed: FeedSpec
) -> tuple[BaseProcess, socket.socket]:
    """Start a child and wait until it has loaded the app (blocking).

    Returns:
        The process and the worker's end of its socket.

    Raises:
        PoolStartError: the forkserver failed, or the child could not load the app or did not
            report ready within ``timeout_s`` (the child is reaped).
    """
    parent_sock, child_sock = socket.socketpair()
    process = context.Process(
        target=main, args=(app_spec, child_sock, feed), name="clockwork-pool", daemon=True
    )
    frame: dict[str, Any] | None
    try:
        with child_sock, _PROCESS_TABLE:  # the child holds its own copy of the socket once started
            process.start()
        parent_sock.settimeout(timeout_s)
        frame = ChildChannel(parent_sock).receive()
        parent_sock.settimeout(None)
    except TimeoutError:
        frame = {"op": "error", "message": f"no ready report within {timeout_s:g} s"}
    except (OSError, EOFError, DecodeError, MessageTooLarge) as exc:  # EOFError: the forkserver died
        frame = {"op": "error", "message": f"{type(exc).__name__}: {exc}"}
    if frame is not None and frame["op"] == "ready":
        return process, parent_sock
    parent_sock.close()
    exitcode = reap(process, grace_s=1.0) if process.pid is not None else None
    reason = f"it exited ({ipc.describe_exit(exitcode)})" if frame is None else frame.get("message")
    detail = f"\n{frame['traceback']}" if frame and frame.get("traceback") else ""
    raise PoolStartError(f"a pool child could not load app {app_spec!r}: {reason}{detail}")


def reap(process: BaseProcess, *, grace_s: float) -> int | None:
    """Wait up to ``grace_s`` for a child to exit, then SIGKILL it; return its exit code (blocking)."""
    # Wait on the sentinel without reading it: only the exitcode read below does, under the lock.
    if not multiprocessing.connection.wait([process.sentinel], grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid or 0, signal.SIGKILL)
        # SIGKILL needs no grace, only the kernel's time to tear the process down.
        multiprocessing.connection.wait([process.sentinel], 5.0)
    with _PROCESS_TABLE:
        exitcode = process.exitcode
        if exitcode is not None:
            process.close()  # frees the sentinel pipe now instead of at garbage collection
    return exitcode
