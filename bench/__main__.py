"""``make bench`` / ``python -m bench``: every benchmark, one JSON line per figure."""

from __future__ import annotations

import sys

from bench import control, fairness, spine

if __name__ == "__main__":
    sys.exit(spine.main() or control.main() or fairness.main())
