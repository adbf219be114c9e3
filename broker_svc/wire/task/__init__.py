"""A task message and the fields Celery gives it: the message, its states, stamps and rate strings."""
