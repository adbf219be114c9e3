"""Your app, as the image in examples/docker/ runs it: its tasks and its periodic schedule."""

from __future__ import annotations

from broker_svc import App, Settings

# Read CLOCKWORK_* from the environment (the compose file sets CLOCKWORK_BROKER_URL).
app = App("myapp", settings=Settings.from_env())
# Fired by `clockwork-beat` (the compose file's beat service), run by the workers.
app.conf.beat_schedule = {"add-every-minute": {"task": "myapp.tasks.add", "schedule": 60.0, "args": (1, 2)}}


@app.task
def add(x: int, y: int) -> int:
    """Add two numbers."""
    return x + y
