"""``GroupResult.restore(id)`` and ``AsyncResult(id)`` without an app read the current app, as Celery's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_svc import App, AsyncResult, GroupResult
from broker_svc.apps import open_apps
from broker_svc.errors import ConfigurationError

URL = "amqp://guest:guest@127.0.0.1:5672/%2Fcurrent-app"


@pytest.fixture
def no_current_app(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(open_apps, "_current", None)


@pytest.fixture
def apps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[App]]:
    monkeypatch.setattr(open_apps, "_current", open_apps._current)  # put back afterwards
    made: list[App] = []
    yield made
    for app in made:
        app.close()


def test_restore_without_an_app_or_a_current_one_says_what_to_do(no_current_app: None):
    with pytest.raises(ConfigurationError, match=r"GroupResult.restore\(id\).*pass app="):
        GroupResult.restore("g")


def test_an_async_result_without_an_app_or_a_current_one_says_what_to_do(no_current_app: None):
    with pytest.raises(ConfigurationError, match=r"AsyncResult\(task_id\).*pass app="):
        AsyncResult("t")


def test_restore_without_an_app_reads_the_app_made_last(apps: list[App]):
    apps.append(App("first", broker=URL))
    apps.append(App("last", broker=URL, backend="rpc://"))
    # It reached the last app's backend: rpc:// keeps no groups, and says so.
    with pytest.raises(NotImplementedError, match="rpc://"):
        GroupResult.restore("g")


def test_an_app_made_without_becoming_current_is_not_read(apps: list[App], no_current_app: None):
    apps.append(App("aside", broker=URL, set_as_current=False))
    with pytest.raises(ConfigurationError):
        GroupResult.restore("g")


def test_an_async_result_without_an_app_is_the_current_apps_handle(apps: list[App]):
    apps.append(App("other", broker=URL))
    app = App("current", broker=URL)
    apps.append(app)
    handle = AsyncResult("t-1")
    assert handle.id == "t-1" and handle.state == "PENDING"
    assert handle._store is app.AsyncResult("t-1")._store
    assert AsyncResult("t-1", app=apps[0])._store is apps[0].AsyncResult("t-1")._store
