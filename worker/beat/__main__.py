"""``python -m worker.beat``: ``clockwork-beat``, as before the scheduler became a package."""

import sys

from worker.beat.cli import main

sys.exit(main())
