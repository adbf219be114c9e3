"""The control plane (mailbox, control client, ``ctl``); it is built on top of ``broker_svc``."""

from __future__ import annotations

__all__: list[str] = []
