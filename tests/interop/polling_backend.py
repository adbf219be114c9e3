"""``ChordBackend`` counting its polls of the reply queue (tests/interop/test_celery_chord.py)."""

from __future__ import annotations

from typing import Any

from broker_svc.celery_backend import ChordBackend


class PollCountingBackend(ChordBackend):
    """Counts the ``basic.get`` polls Celery's rpc backend makes of the reply queue."""

    polls = 0

    def _slurp_from_queue(self, *args: Any, **kwargs: Any) -> Any:
        type(self).polls += 1
        return super()._slurp_from_queue(*args, **kwargs)
