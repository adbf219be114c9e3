"""Every Settings field is read from CLOCKWORK_<FIELD>; the two older names stay aliases."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import pytest

from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings, env_vars

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A value for each field's variable and what the field holds then (none of them the default).
SAMPLES: dict[str, tuple[str, Any]] = {
    "broker_url": ("amqp://u:p@rabbit:5672/v", "amqp://u:p@rabbit:5672/v"),
    "default_queue": ("orders", "orders"),
    "serializer": ("json", "json"),
    "accept_content": ("json", ("json",)),
    "max_body_bytes": ("1024", 1024),
    "quorum_queues": ("a, b,,", ("a", "b")),
    "ordered_queues": ("updates, ledger", ("updates", "ledger")),
    "queue_max_priority": ("10", 10),
    "delivery_limit": ("5", 5),
    "confirm": ("each", "each"),
    "publish_attempts": ("7", 7),
    "max_unconfirmed": ("100", 100),
    "confirm_timeout_s": ("2.5", 2.5),
    "connect_timeout_s": ("1.5", 1.5),
    "reconnect_window_s": ("60", 60.0),
    "heartbeat_s": ("10", 10),
    "result_expires_s": ("60", 60),
    "result_persistent": ("yes", True),
    "task_states": ("1", True),
    "control_signing_key": ("s3cret", "s3cret"),
    "control_allowed_users": ("ops, worker", ("ops", "worker")),
    "ssl_ca_file": ("/ca.pem", "/ca.pem"),
    "ssl_cert_file": ("/cert.pem", "/cert.pem"),
    "ssl_key_file": ("/key.pem", "/key.pem"),
    "spool_dir": ("/var/spool/app", "/var/spool/app"),
    "spool_max_bytes": ("1048576", 1048576),
    "spool_memory_records": ("20000", 20000),
    "spool_flush_count": ("64", 64),
    "spool_flush_interval_s": ("0.5", 0.5),
    "spool_fsync": ("off", False),
    "app_namespace": ("billing", "billing"),
}


def test_every_field_but_the_ssl_context_has_its_own_variable() -> None:
    names = [f.name for f in dataclasses.fields(Settings) if f.name != "ssl_context"]
    assert sorted(env_vars()) == sorted(names) == sorted(SAMPLES)
    assert all(env_vars()[name][0] == f"CLOCKWORK_{name.upper()}" for name in names)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_variable_sets_its_field(name: str) -> None:
    text, expected = SAMPLES[name]
    env = {f"CLOCKWORK_{name.upper()}": text}
    if name == "ssl_key_file":
        env["CLOCKWORK_SSL_CERT_FILE"] = "/cert.pem"  # a key needs its certificate
    settings = Settings.from_env(env)
    assert getattr(settings, name) == expected
    assert getattr(Settings(), name) != expected


def test_the_older_names_are_aliases_and_the_fields_own_name_wins() -> None:
    old = Settings.from_env({"CLOCKWORK_CONTROL_KEY": "k1", "CLOCKWORK_CONTROL_USERS": "a,b"})
    assert (old.control_signing_key, old.control_allowed_users) == ("k1", ("a", "b"))
    both = Settings.from_env({"CLOCKWORK_CONTROL_KEY": "k1", "CLOCKWORK_CONTROL_SIGNING_KEY": "k2"})
    assert both.control_signing_key == "k2"


@pytest.mark.parametrize(
    ("var", "text", "message"),
    [
        ("CLOCKWORK_PUBLISH_ATTEMPTS", "many", "must be an integer"),
        ("CLOCKWORK_CONFIRM_TIMEOUT_S", "soon", "must be a number"),
        ("CLOCKWORK_RESULT_PERSISTENT", "perhaps", "must be one of"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused(var: str, text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Settings.from_env({var: text})


def test_the_guide_lists_every_variable() -> None:
    guide = (ROOT / "docs" / "guide.md").read_text()
    missing = [var for names in env_vars().values() for var in names if f"`{var}`" not in guide]
    assert missing == []
