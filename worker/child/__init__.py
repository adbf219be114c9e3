"""A pool child: its entry point, its consumers (one per thread), time limits, a task body's run."""
