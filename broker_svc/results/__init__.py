"""What a client reads back: ``AsyncResult``, ``GroupResult``, and task states as jobs."""
