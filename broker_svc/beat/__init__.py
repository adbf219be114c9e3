"""The periodic scheduler (``clockwork-beat``, ``worker -B``): see ``broker_svc/beat/scheduler.py``."""
