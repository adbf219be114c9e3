"""A Celery app's surface on ``App``: constructor, ``app.conf``, routes, shared tasks, task options."""

from __future__ import annotations

import datetime as dt
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from structlog.testing import capture_logs

from broker_svc import App, ConfigurationError, Retry, current_app, shared_task
from broker_svc.sending.routes import route_for
from broker_svc.tasks.task import Request, executing

URL = "amqp://guest:guest@127.0.0.1:5672/%2Fsurface"


def test_the_celery_constructor_takes_broker_backend_include_and_settings_by_celery_names():
    app = App("proj", broker=URL, backend="rpc://", include=["proj.tasks"], task_default_queue="jobs")
    assert app.settings.broker_url == URL
    assert app.settings.default_queue == "jobs"
    assert app.conf.include == ["proj.tasks"]
    assert app.conf["result_backend"] == "rpc://"


def test_a_result_backend_other_than_rpc_or_redis_is_refused_not_ignored():
    with pytest.raises(ConfigurationError, match="rpc://"):
        App("proj", broker=URL, backend="mongodb://localhost/0")
    # Celery's Redis backend is written and read in Celery's format (broker_svc/redis_results/).
    assert (
        App("proj", broker=URL, backend="redis://localhost/0").conf["result_backend"] == "redis://localhost/0"
    )
    app = App("proj", broker=URL)
    with pytest.raises(ConfigurationError, match="rpc://"):
        app.conf.result_backend = "db+sqlite:///results.db"
    assert "result_backend" not in app.conf
    # Clockwork's own Celery backend (rpc:// plus chords) is what our client does: accepted.
    moved = App("proj", broker=URL, backend="broker_svc.celery_backend:ChordBackend")
    assert moved.conf["result_backend"] == "broker_svc.celery_backend:ChordBackend"


def test_conf_changes_the_settings_under_celery_names():
    app = App("proj", broker=URL)
    app.conf.update(task_serializer="json", accept_content=["json"], result_expires=dt.timedelta(hours=2))
    app.conf.broker_heartbeat = 10
    assert app.settings.serializer == "json"
    assert app.settings.accept_content == ("json",)
    assert app.settings.result_expires_s == 7200
    assert app.settings.heartbeat_s == 10
    assert app.conf.task_serializer == "json"  # read back by attribute, as Celery's conf


def test_an_invalid_setting_raises_and_changes_nothing():
    app = App("proj", broker=URL)
    with pytest.raises(ConfigurationError, match="serializer"):
        app.conf.update(task_serializer="pickle", task_default_queue="other")
    assert app.settings.serializer == "msgpack"
    assert app.settings.default_queue == "celery"
    assert "task_default_queue" not in app.conf


def test_config_from_object_reads_a_django_style_namespace():
    class DjangoSettings:
        CELERY_BROKER_URL = URL
        CELERY_TASK_DEFAULT_QUEUE = "from-django"
        CELERY_TASK_ROUTES = {"a.*": "q-a"}
        DEBUG = True  # not in the namespace: not read

    app = App("proj")
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert app.settings.broker_url == URL
    assert app.settings.default_queue == "from-django"
    assert app.conf.task_routes == {"a.*": "q-a"}
    assert "debug" not in app.conf


def test_config_from_object_takes_a_dotted_module_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "celeryconfig_surface.py").write_text(
        "task_default_queue = 'from-module'\nbroker_heartbeat = 7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    app = App("proj", broker=URL)
    app.config_from_object("celeryconfig_surface")
    assert (app.settings.default_queue, app.settings.heartbeat_s) == ("from-module", 7)
    app.config_from_object("no_such_config_module_here", silent=True)
    with pytest.raises(ImportError):
        app.config_from_object("no_such_config_module_here")


def test_a_celery_setting_that_does_nothing_here_is_named_once_in_a_warning():
    app = App("proj", broker=URL)
    with capture_logs() as logs:
        app.conf.worker_max_tasks_per_child_unknown_to_us = 5
        app.conf.worker_max_tasks_per_child_unknown_to_us = 6
        app.conf.task_acks_late = True  # what Clockwork always does: no warning
        app.conf.my_own_setting = 1  # not a Celery name: the user's own, kept quietly
    warned = [e for e in logs if e["event"] == "celery_setting_not_used"]
    assert [e["setting"] for e in warned] == ["worker_max_tasks_per_child_unknown_to_us"]
    assert app.conf.my_own_setting == 1


def test_routes_take_every_celery_form_and_an_exact_name_beats_a_pattern():
    def router(name, args, kwargs, options, task=None, **kw):
        return {"queue": "from-router"} if name == "r.task" else None

    routes = [
        {
            "a.exact": {"queue": "exact"},
            "a.*": "glob",
            re.compile(r"^b\."): {"queue": "regex", "priority": 3},
        },
        router,
    ]
    assert route_for(routes, "a.exact", (), {}, {}) == {"queue": "exact"}
    assert route_for(routes, "a.other", (), {}, {}) == {"queue": "glob"}
    assert route_for(routes, "b.x", (), {}, {}) == {"queue": "regex", "priority": 3}
    assert route_for(routes, "r.task", (), {}, {}) == {"queue": "from-router"}
    assert route_for(routes, "nothing.matches", (), {}, {}) == {}
    assert route_for({"c": {"routing_key": "rk"}}, "c", (), {}, {}) == {"queue": "rk"}


def test_a_route_to_another_exchange_is_kept_with_its_routing_key():
    assert route_for({"t": {"exchange": "media", "routing_key": "video.hd"}}, "t", (), {}, {}) == {
        "exchange": "media",
        "routing_key": "video.hd",
    }
    # Celery's pairing of a queue with its same-named exchange is plain queue routing.
    assert route_for({"t": {"queue": "q", "exchange": "q", "routing_key": "q"}}, "t", (), {}, {}) == {
        "queue": "q"
    }
    with pytest.raises(ConfigurationError, match="routing key is the queue's name"):
        route_for({"t": {"queue": "q", "routing_key": "other"}}, "t", (), {}, {})


def test_shared_tasks_land_on_every_app_and_the_proxy_sends_through_the_current_one():
    before = App("before", broker=URL)

    @shared_task(name="surface.shared_double")
    def double(x: int) -> int:
        return 2 * x

    after = App("after", broker=URL)
    assert "surface.shared_double" in before.tasks
    assert "surface.shared_double" in after.tasks
    assert current_app() is after
    assert double.app is after  # attribute access goes to the current app's task
    assert double(4) == 8
    App("not-current", broker=URL, set_as_current=False)
    assert current_app() is after


def test_task_options_celery_code_uses_are_accepted_with_their_meaning():
    app = App("proj", broker=URL)

    @app.task(
        acks_late=True, reject_on_worker_lost=True, throws=(KeyError,), expires=60, priority=5,
        typing=True, store_errors_even_if_ignored=True, retry_kwargs={"max_retries": 2},
        dont_autoretry_for=(ValueError,), autoretry_for=(Exception,),
    )  # fmt: skip
    def job(x: int) -> int:
        return x

    options = job.signature((1,)).options
    assert options["expires"] == 60
    assert options["priority"] == 5
    assert job.throws == (KeyError,)


def test_typing_refuses_wrong_arguments_before_anything_is_sent():
    app = App("proj", broker=URL)

    @app.task
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(typing=False)
    def loose(x: int) -> int:
        return x

    with pytest.raises(TypeError, match="add"):
        add.delay(1)  # type: ignore[call-arg]  # mypy catches it too (Task[P, R])
    with pytest.raises(TypeError):
        add.apply_async((1, 2, 3))
    assert app._producer is None  # nothing connected, nothing sent
    sent: list[tuple[str, object]] = []
    app.send_task = lambda name, args, kwargs, **options: sent.append((name, args))  # type: ignore[method-assign,assignment]
    loose.apply_async((1, 2))  # typing=False: the worker's run will report the mismatch instead
    assert sent == [(loose.name, (1, 2))]


def _run_in_worker(task, *args):
    request = Request(id="t1", task=task.name, called_directly=False)
    with executing(request):
        return task.execute(args, {})


def test_retry_kwargs_and_dont_autoretry_for_shape_autoretries():
    app = App("proj", broker=URL)

    @app.task(
        autoretry_for=(OSError,), dont_autoretry_for=(FileNotFoundError,), retry_kwargs={"countdown": 42}
    )
    def flaky(kind: str) -> None:
        raise FileNotFoundError(kind) if kind == "missing" else OSError(kind)

    with pytest.raises(Retry) as retried:
        _run_in_worker(flaky, "io")
    assert retried.value.eta is not None
    delay = (retried.value.eta - dt.datetime.now(dt.UTC)).total_seconds()
    assert 40 < delay <= 42
    with pytest.raises(FileNotFoundError):  # excluded: fails at once, no retry
        _run_in_worker(flaky, "missing")


def test_autodiscover_imports_each_packages_tasks_module_and_skips_those_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    package = tmp_path / "surface_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tasks.py").write_text(
        textwrap.dedent(
            """
            from broker_svc import shared_task

            @shared_task
            def found_by_autodiscover():
                return "found"
            """
        )
    )
    (tmp_path / "surface_empty").mkdir()
    (tmp_path / "surface_empty" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    app = App("proj", broker=URL)
    app.autodiscover_tasks(["surface_pkg", "surface_empty"])
    assert "surface_pkg.tasks.found_by_autodiscover" not in app.tasks  # lazy, as Celery's
    assert app.import_task_modules() == ["surface_pkg.tasks"]
    assert "surface_pkg.tasks.found_by_autodiscover" in app.tasks
    sys.modules.pop("surface_pkg.tasks", None)


class Order(BaseModel):
    sku: str
    quantity: int


class Receipt(BaseModel):
    sku: str
    total: int


def test_pydantic_models_are_validated_in_and_dumped_out():
    app = App("proj", broker=URL)

    @app.task(pydantic=True)
    def checkout(order: Order, price: int) -> Receipt:
        assert isinstance(order, Order)
        return Receipt(sku=order.sku, total=order.quantity * price)

    assert _run_in_worker(checkout, {"sku": "a1", "quantity": "3"}, 5) == {"sku": "a1", "total": 15}
    with pytest.raises(ValidationError):
        _run_in_worker(checkout, {"sku": "a1"}, 5)

    @app.task(pydantic=True, pydantic_strict=True)
    def strict(order: Order) -> int:
        return order.quantity

    with pytest.raises(ValidationError):  # "3" is not an int in strict mode
        _run_in_worker(strict, {"sku": "a1", "quantity": "3"})

    @app.task(pydantic=True)
    async def checkout_async(order: Order, price: int) -> Receipt:
        return Receipt(sku=order.sku, total=order.quantity * price)

    # An async def body's model is dumped once awaited (apply() awaits it as a worker does).
    assert checkout_async.apply(({"sku": "a1", "quantity": "3"}, 5)).get() == {"sku": "a1", "total": 15}


def test_one_rule_explicit_argument_then_conf_then_environment_then_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_DEFAULT_QUEUE", "from-env")
    monkeypatch.setenv("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/from-env")
    assert App("a").settings.default_queue == "from-env"
    assert App("b", task_default_queue="from-conf").settings.default_queue == "from-conf"
    assert App("c", broker=URL).settings.broker_url == URL
    monkeypatch.delenv("CLOCKWORK_DEFAULT_QUEUE")
    assert App("d").settings.default_queue == "celery"


# Per setting Celery names: (conf value, env text, the field's value from each, the default).
_PRECEDENCE: dict[str, tuple[Any, str]] = {
    "broker_url": ("amqp://guest:guest@h1:5672/conf", "amqp://guest:guest@h2:5672/env"),
    "task_default_queue": ("q-conf", "q-env"),
    "task_serializer": ("msgpack", "json"),
    "accept_content": (["json"], "msgpack"),
    "result_expires": (60, "120"),
    "result_persistent": (False, "true"),
    "broker_heartbeat": (11, "22"),
    "broker_connection_timeout": (3.5, "7.5"),
}


@pytest.mark.parametrize("celery_name", sorted(_PRECEDENCE))
def test_each_setting_follows_the_one_rule(celery_name: str, monkeypatch: pytest.MonkeyPatch):
    from broker_svc.apps.conf import SETTINGS_FIELDS
    from broker_svc.settings import Settings

    field, convert = SETTINGS_FIELDS[celery_name]
    conf_value, env_text = _PRECEDENCE[celery_name]
    default = getattr(App("defaults", broker=URL).settings, field) if celery_name != "broker_url" else None
    monkeypatch.setenv(f"CLOCKWORK_{field.upper()}", env_text)
    from_env = getattr(Settings.from_env(), field)
    assert from_env != default  # the environment changes it
    assert getattr(App("env").settings, field) == from_env  # no argument, no conf: the environment
    by_conf = getattr(App("conf", **{celery_name: conf_value}).settings, field)
    assert by_conf == convert(conf_value) and by_conf != from_env  # app.conf beats the environment
    explicit = App("explicit", settings=Settings(**{field: convert(conf_value)}))
    assert getattr(explicit.settings, field) == convert(conf_value)  # the argument beats both
