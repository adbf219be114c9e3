"""The periodic scheduler (``clockwork-beat``, ``worker -B``): see ``worker/beat/scheduler.py``."""
