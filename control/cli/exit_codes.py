"""``ctl``'s exit statuses (control/cli/main.py says when each is used)."""

from __future__ import annotations

from typing import Final

__all__ = ["EX_FAILURE", "EX_OK", "EX_UNAVAILABLE"]

EX_OK: Final = 0
EX_FAILURE: Final = 1
EX_UNAVAILABLE: Final = 69  # sysexits.h, what `celery inspect` returns when nobody answered
