"""What hangs off an App: Celery's app.conf, app.control, and the apps open in this process."""
