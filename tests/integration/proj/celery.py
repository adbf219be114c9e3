"""The project's app module (Celery's ``proj/celery.py`` layout)."""

import os

# from celery import Celery
from broker_svc import App as Celery

app = Celery(
    "proj",
    broker=os.environ.get("PROJ_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    backend="rpc://",
    include=["tests.integration.proj.tasks"],
)
slow_queue = os.environ.get("PROJ_SLOW_QUEUE", "proj-slow")
app.conf.update(
    task_default_queue=os.environ.get("PROJ_QUEUE", "proj"),
    task_routes={"tests.integration.proj.tasks.slow_*": {"queue": slow_queue}},
    task_serializer="json",
    accept_content=["json"],
    result_expires=3600,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)
