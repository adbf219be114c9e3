"""What ``inspect registered``, ``conf`` and ``report`` answer, as Celery's workers answer them.

tests/interop/test_celery_task_api.py asks a Celery worker and ours the same over the broker.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pytest

from broker_svc import App
from worker.config import WorkerConfig
from worker.remote.bug_report import bug_report
from worker.remote.commands import DEFAULT_TASK_INFO_ITEMS, task_info
from worker.remote.conf_table import CELERY_DEFAULTS, conf_table, plain

URL = "amqp://guest:secret@127.0.0.1:5672/%2Finspect"


@pytest.fixture
def app() -> App:
    app = App("proj", broker=URL, set_as_current=False)

    @app.task(name="proj.limited", rate_limit="10/s", max_retries=5)
    def limited() -> None: ...

    @app.task(name="proj.plain")
    def plain_task() -> None: ...

    return app


def config(app: App, **options: object) -> WorkerConfig:
    return WorkerConfig(
        app_spec="proj.celery:app", settings=app.settings, concurrency=2, hostname="w1@host",
        state_path=Path("/var/lib/clockwork/w1.state"), **options,  # type: ignore[arg-type]
    )  # fmt: skip


def test_registered_items_are_celerys_name_and_attributes(app: App):
    limited, bare = app.tasks["proj.limited"], app.tasks["proj.plain"]
    assert task_info(limited, DEFAULT_TASK_INFO_ITEMS) == "proj.limited [rate_limit=10/s]"
    assert task_info(bare, DEFAULT_TASK_INFO_ITEMS) == "proj.plain"
    assert task_info(limited, ["max_retries", "rate_limit"]) == "proj.limited [max_retries=5 rate_limit=10/s]"
    assert task_info(bare, ["default_retry_delay", "no_such"]) == "proj.plain [default_retry_delay=180]"


def test_conf_without_defaults_is_what_differs_from_celery_or_the_app_set(app: App):
    app.conf.update(task_serializer="json", worker_hijack_root_logger=False, task_routes={"a.*": "q"})
    table = conf_table(app, config(app), task_events=False, with_defaults=False)
    # Set by the app, answered with what the worker does.
    assert table["task_serializer"] == "json" and table["task_routes"] == {"a.*": "q"}
    assert table["worker_hijack_root_logger"] is True
    # Differ from Celery's defaults.
    assert table["task_acks_late"] is True and table["worker_prefetch_multiplier"] == 1
    assert table["include"] == ["proj.celery"]
    assert table["broker_url"] == "amqp://guest:***@127.0.0.1:5672/%2Finspect"
    # Celery's defaults, not set here: left out.
    assert not {"enable_utc", "worker_pool", "task_protocol", "control_exchange"} & set(table)
    for key, value in table.items():
        assert key in app.conf or key not in CELERY_DEFAULTS or value != CELERY_DEFAULTS[key], key


def test_conf_with_defaults_is_every_celery_setting_we_have(app: App):
    full = conf_table(app, config(app), task_events=True, with_defaults=True)
    assert set(CELERY_DEFAULTS) <= set(full)
    assert full["worker_send_task_events"] is True
    assert (full["control_queue_ttl"], full["control_queue_expires"]) == (300.0, 10.0)
    assert full["worker_state_db"] == "/var/lib/clockwork/w1.state"
    json.dumps(full)  # JSON-ready


def test_conf_leaves_out_settings_clockwork_does_not_use_and_masks_secrets(app: App):
    app.conf.update(worker_disable_rate_limits_please=True, task_states=True, security_key="s3cret")
    full = conf_table(app, config(app), task_events=False, with_defaults=True)
    assert "worker_disable_rate_limits_please" not in full  # no effect here: not listed
    assert full["task_states"] is True  # Clockwork's own setting, set by the app
    assert "security_key" not in full and "s3cret" not in json.dumps(full)
    assert full["task_default_routing_key"] == "********"  # a name Celery masks too ("KEY")


def test_plain_values_are_celerys_json_forms():
    assert plain(
        (1, {2, 3}.__class__([2])),
    ) == [1, [2]]
    assert plain({"every": dt.timedelta(seconds=90), 1: dt.date(2026, 1, 2)}) == {
        "every": "0:01:30", "1": "2026-01-02"
    }  # fmt: skip
    assert plain(re.compile("a.*")) == "re.compile('a.*')"


def test_the_report_reads_as_celerys(app: App):
    table = conf_table(app, config(app), task_events=False, with_defaults=False)
    text = bug_report(app_spec="proj.celery:app", results="rpc://", settings=table)
    lines = text.splitlines()
    assert lines[0] == ""
    assert lines[1].startswith("software -> clockwork:") and " py:" in lines[1]
    assert lines[2].strip().startswith("pika:")
    assert lines[3].startswith("platform -> system:") and lines[4].strip().startswith("kernel version:")
    assert lines[5:7] == ["loader   -> proj.celery:app", "settings -> transport:amqp results:rpc://"]
    assert "task_acks_late: True" in lines
    assert "include: " in lines and "    ['proj.celery']" in lines
    assert "secret" not in text
