"""The control plane (mailbox, control client, ``ctl``); it is built on top of ``broker_svc``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from control.api import Control, Inspect
    from control.blocking.client import ControlClient
    from control.blocking.dead_letters import DeadLetters
    from control.protocol.collector import ReplyCollector
    from control.protocol.membership import Membership
    from control.protocol.replies import BroadcastResult, InspectReply, RevokeResult

__all__ = [
    # the Celery-shaped facade (``app.control``)
    "Control",
    "Inspect",
    # the blocking client and what it returns
    "BroadcastResult",
    "ControlClient",
    "InspectReply",
    "RevokeResult",
    # dead letters: list, show, requeue, purge (``app.control.dead_letters()``)
    "DeadLetters",
    # pure building blocks
    "Membership",
    "ReplyCollector",
]

# Loaded on first use: the worker imports the mailbox node (aio-pika) from this package and needs
# none of the blocking client (pika) unless a task uses ``app.control``. Each name points at the
# module that defines it, so the pure results load without pika.
_EXPORTS = {
    "Control": "control.api",
    "Inspect": "control.api",
    "BroadcastResult": "control.protocol.replies",
    "ControlClient": "control.blocking.client",
    "InspectReply": "control.protocol.replies",
    "RevokeResult": "control.protocol.replies",
    "DeadLetters": "control.blocking.dead_letters",
    "Membership": "control.protocol.membership",
    "ReplyCollector": "control.protocol.collector",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)
