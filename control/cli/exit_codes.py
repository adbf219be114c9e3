"""``ctl``'s exit statuses (control/cli/main.py says when each is used)."""

from __future__ import annotations

from typing import Final

__all__ = ["EX_FAILURE", "EX_OK", "EX_UNAVAILABLE", "EX_USAGE"]

EX_OK: Final = 0
EX_FAILURE: Final = 1
EX_USAGE: Final = 2  # as argparse exits for a usage error
EX_UNAVAILABLE: Final = 69  # sysexits.h, what `celery inspect` returns when nobody answered
