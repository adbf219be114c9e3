"""``make bench`` / ``python -m bench``: every benchmark, one JSON line per figure."""

from __future__ import annotations

import sys

from bench import control, spine

if __name__ == "__main__":
    status = spine.main()
    sys.exit(status or control.main())
