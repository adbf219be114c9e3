"""A Celery project of ordinary idioms, moved to Clockwork by changing only its import lines.

Each changed line keeps Celery's import as a comment above it.
"""
