"""The project's tasks, defined without the app (``shared_task``), as reusable Celery apps do."""

# from celery import shared_task
from broker_svc import shared_task


@shared_task
def add(x: int, y: int) -> int:
    return x + y


@shared_task(bind=True)
def whoami(self) -> dict[str, object]:
    return {"task": self.name, "queue": self.request.delivery_info.get("routing_key")}


@shared_task(bind=True)
def slow_echo(self, value: str) -> list[str]:
    return [value, self.request.delivery_info.get("routing_key")]


@shared_task(throws=(KeyError,))
def lookup(key: str) -> str:
    raise KeyError(key)


@shared_task(ignore_result=True, store_errors_even_if_ignored=True)
def quiet_failure() -> None:
    raise ValueError("reported although results are ignored")


@shared_task(autoretry_for=(OSError,), retry_kwargs={"max_retries": 1, "countdown": 0.2})
def always_oserror() -> None:
    raise OSError("disk on fire")
