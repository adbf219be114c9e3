"""The asyncio client (aio-pika): ``AsyncApp`` beside an ``App``; results pushed, never polled.

Its exports load on first use (PEP 562), so importing the package costs nothing until it is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from broker_svc.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from broker_svc.aio.app import AsyncApp
    from broker_svc.aio.results import AioGroupResult, AioResult

__all__ = ["AioGroupResult", "AioResult", "AsyncApp"]

__getattr__ = lazy_exports(
    __name__,
    {
        "AsyncApp": "broker_svc.aio.app",
        "AioResult": "broker_svc.aio.results",
        "AioGroupResult": "broker_svc.aio.results",
    },
)
