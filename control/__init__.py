"""The control plane (mailbox, control client, ``ctl``); it is built on top of ``broker_svc``."""

from __future__ import annotations

from control.api import Control, Inspect
from control.client import BroadcastResult, ControlClient, InspectReply, RevokeResult
from control.collect import ReplyCollector
from control.members import Membership

__all__ = [
    # the Celery-shaped facade (``app.control``)
    "Control",
    "Inspect",
    # the blocking client and what it returns
    "BroadcastResult",
    "ControlClient",
    "InspectReply",
    "RevokeResult",
    # pure building blocks
    "Membership",
    "ReplyCollector",
]
