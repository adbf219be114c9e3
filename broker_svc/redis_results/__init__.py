"""Celery's Redis result backend, written by workers and read by clients (blocking, redis-py)."""
