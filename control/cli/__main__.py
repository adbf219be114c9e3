"""``python -m control.cli``: the same as the ``ctl`` command."""

import sys

from control.cli.main import main

sys.exit(main())
