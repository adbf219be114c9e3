"""A task's run: traced in a worker, applied eagerly, or handed to a replacement."""
