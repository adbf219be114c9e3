"""``python -m bench``: the side-by-side run of ``bench.compare`` (``make bench`` runs the same).

The single-system figures stay runnable on their own: ``python -m bench.spine``, ``bench.control``,
``bench.fairness``.
"""

from __future__ import annotations

import sys

from bench import compare

if __name__ == "__main__":
    sys.exit(compare.main())
