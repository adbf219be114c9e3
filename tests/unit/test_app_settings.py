"""An App reads the broker and every other setting as the worker and ``ctl`` do: argument, then
``CLOCKWORK_*`` variable, then the default."""

from __future__ import annotations

import pytest

from broker_svc import App, ConfigurationError, Settings

URL = "amqp://user:secret@rabbit.example:5672/jobs"


def test_an_app_without_a_broker_url_takes_clockwork_broker_url(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_BROKER_URL", URL)
    with App("x") as app:
        assert app.settings.broker_url == URL


def test_the_argument_wins_over_the_variable(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_BROKER_URL", URL)
    with App("x", broker_url="amqp://guest:guest@127.0.0.1:5672/other") as app:
        assert app.settings.broker_url == "amqp://guest:guest@127.0.0.1:5672/other"


def test_other_settings_come_from_their_variables_too(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_DEFAULT_QUEUE", "jobs")
    with App("x", broker_url=URL) as app:
        assert app.settings.default_queue == "jobs"


def test_settings_given_whole_are_used_as_given(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_BROKER_URL", URL)
    with App("x", settings=Settings()) as app:
        assert app.settings.broker_url == Settings().broker_url != URL


def test_without_the_variable_the_default_broker_is_used(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("CLOCKWORK_BROKER_URL", raising=False)
    with App("x") as app:
        assert app.settings.broker_url == Settings().broker_url


def test_an_invalid_variable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CLOCKWORK_CONFIRM_TIMEOUT_S", "soon")
    with pytest.raises(ConfigurationError, match="CLOCKWORK_CONFIRM_TIMEOUT_S"):
        App("x")


def test_app_conf_set_after_the_constructor_wins_over_its_argument_and_the_variable(
    monkeypatch: pytest.MonkeyPatch,
):
    # The order docs/guide.md gives for a worker without -b: the app's broker_url as its module
    # left it (the last of App(broker=...) and app.conf), else CLOCKWORK_BROKER_URL.
    monkeypatch.setenv("CLOCKWORK_BROKER_URL", URL)
    argument, configured = (
        "amqp://guest:guest@127.0.0.1:5672/argument",
        "amqp://guest:guest@127.0.0.1:5672/conf",
    )

    class CeleryConfig:
        broker_url = configured

    with App("x", broker=argument, config_source=CeleryConfig) as app:
        assert app.settings.broker_url == configured
    with App("x", broker=argument) as app:
        app.config_from_object(CeleryConfig)
        assert app.settings.broker_url == configured
    with App("x", settings=Settings(broker_url=argument)) as app:
        app.conf.broker_url = configured
        assert app.settings.broker_url == configured
