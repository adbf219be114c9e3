"""The project's tasks, defined without the app (``shared_task``), as reusable Celery apps do."""

# from celery import shared_task
# from celery.exceptions import Ignore, Reject
from broker_svc import Ignore, Reject, shared_task


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


@shared_task
def handled_elsewhere() -> None:
    raise Ignore()


@shared_task
def refuse(reason: str) -> None:
    raise Reject(reason, requeue=False)


@shared_task(bind=True)
def refuse_first_delivery(self) -> str:
    if not self.request.delivery_info.get("redelivered"):
        raise Reject("not on the first delivery", requeue=True)
    return "second delivery"


@shared_task(bind=True)
def grow(self, x: int, *, scale: int = 1) -> list[int]:
    """Retries once with new arguments, as ``self.retry(args=..., kwargs=...)`` allows."""
    if self.request.retries == 0:
        raise self.retry(args=(x * 100,), kwargs={"scale": 2}, countdown=0.1)
    return [x, scale]


@shared_task(bind=True)
def headers_seen(self) -> dict[str, object]:
    """What a task sees of its message's custom headers, both ways Celery shows them."""
    return {"headers": self.request.headers, "tenant": getattr(self.request, "tenant", None)}
