"""A pool child's entry point: load the app, report ready, consume (``worker/pool/spawn.py`` starts one)."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import select
import signal
import socket
import threading
import traceback

from broker_svc import signals
from broker_svc.logging import configure_logging
from worker import ipc
from worker.child.channel import ChildChannel
from worker.child.serve import serve
from worker.child.soft_limits import SoftLimit
from worker.child.spec import FeedSpec
from worker.loader import FORKSERVER_ENV, SAFE_PATH_ADDED_ENV, extend_path_from_environment, load_app

__all__ = ["main"]

# Imported first in the forkserver (its preload): the user's modules are found from here on, after
# ours, and a PYTHONSAFEPATH the pool set only for the forkserver does not reach task code.
extend_path_from_environment()
if os.environ.pop(SAFE_PATH_ADDED_ENV, None):
    os.environ.pop("PYTHONSAFEPATH", None)
# The forkserver imports the app next, as the worker did before starting it: what the app's import
# logs (a Celery setting that does nothing here, say) the worker has said once already. Each child
# turns logging back on (``main``).
if os.environ.pop(FORKSERVER_ENV, None):
    logging.disable(logging.CRITICAL)


def main(app_spec: str, sock: socket.socket, feed: FeedSpec) -> None:
    """Consume and run tasks until the worker closes the socket; the target of the pool's ``Process``.

    Args:
        app_spec: ``package.module:attr`` of the app whose tasks this child runs.
        sock: this child's end of the socket pair.
        feed: where to connect and what to consume (``worker/child/serve.py``).
    """
    # What the forkserver imported is shared with it until written: keep the collector from walking
    # (and so writing to) those objects, which would copy their pages into every child.
    gc.freeze()
    # Ctrl-C reaches the whole process group; the worker alone decides when children stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A child is an entry point of its own: hook failures and task logs use the worker's level.
    logging.disable(logging.NOTSET)  # off in the forkserver it was forked from, while it preloaded
    configure_logging(os.environ.get("CLOCKWORK_LOGLEVEL", "info"))
    soft_limit = SoftLimit()
    sock.setblocking(True)
    channel = ChildChannel(sock)
    try:
        try:
            app = load_app(app_spec)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            channel.send(
                ipc.encode_frame({"op": "error", "message": message, "traceback": traceback.format_exc()})
            )
            raise SystemExit(1) from None
        if app.settings.broker_url != feed.settings.broker_url:
            # The worker's -b: what a task sends goes to the broker the worker consumes from, not
            # to the one the app module names (or CLOCKWORK_BROKER_URL) without it.
            app.conf["broker_url"] = feed.settings.broker_url
        signals.worker_process_init.send(sender=None)
        channel.send(ipc.encode_frame({"op": "ready", "pid": os.getpid()}))
        _exit_with_the_worker()
        serve(app, feed, channel, soft_limit)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker is gone; so are we
    finally:
        sock.close()


def _exit_with_the_worker() -> None:
    # A busy child would otherwise run its task to the end before it saw the closed socket. The
    # forkserver cannot tell us (children keep it alive), but multiprocessing gives each child the
    # read end of a pipe whose write end only the worker holds: end of file there means it is gone.
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        while True:
            select.select([sentinel], [], [])
            if not os.read(sentinel, 4096):
                os._exit(1)

    # The thread starts with every signal blocked, so a signal always interrupts the main thread's
    # blocking calls (a signal delivered to another thread would not wake a task's sleep()).
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        threading.Thread(target=watch, name="clockwork-orphan-watch", daemon=True).start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
