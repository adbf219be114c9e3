"""Tasks: the ``Task`` class, the registry, a request, and one run of a task body."""
