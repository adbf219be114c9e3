"""WorkerConfig refuses bad options with ConfigurationError; the event heartbeat has its own name."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings
from worker.config import WorkerConfig


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency": 0},
        {"prefetch_multiplier": 0},
        {"queues": ("",)},
        {"dedupe_window_s": 0.0},
        {"event_heartbeat_s": 0.0},
        {"broker_heartbeat_s": -1},
        {"consumer_timeout_s": 0.0},
        {"hostname": "no-at-sign"},
        {"concurrency": 1, "autoscale": (1, 2)},
        {"concurrency": 5, "autoscale": (4, 1)},
        {"concurrency": 1, "autoscale": (4, 1), "autoscale_keepalive_s": 0.0},
    ],
)
def test_bad_options_raise_configuration_error(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        WorkerConfig(app_spec="m:app", settings=Settings(), **options)


def test_the_event_heartbeat_is_not_the_amqp_heartbeat() -> None:
    config = WorkerConfig(app_spec="m:app", settings=Settings(heartbeat_s=30), event_heartbeat_s=5.0)
    assert config.event_heartbeat_s == 5.0
    assert (config.broker_heartbeat_s, config.settings.heartbeat_s) == (None, 30)
