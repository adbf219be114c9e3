from __future__ import annotations

import pytest

from broker_svc import topology
from broker_svc.errors import ConfigurationError
from broker_svc.settings import Settings, redact_url


def test_task_queue_is_declared_like_celerys():
    spec = topology.task_queue("celery")
    assert (spec.name, spec.durable, spec.exclusive, spec.auto_delete, spec.arguments) == (
        "celery", True, False, False, {}
    )  # fmt: skip
    assert spec.exchange == topology.ExchangeSpec("celery", "direct", durable=True)
    assert spec.routing_key == "celery"
    assert topology.task_queue("q", queue_type="quorum").arguments == {"x-queue-type": "quorum"}


def test_result_queue_expires_and_survives_reconnects():
    spec = topology.result_queue("r", expires_s=86_400)
    assert spec.arguments == {"x-expires": 86_400_000} and spec.durable and not spec.exclusive


def test_dead_letter_queue_is_named_after_its_queue():
    assert topology.dead_letter_queue("celery").name == "celery.dead"


def test_settings_hide_the_password():
    settings = Settings(broker_url="amqp://user:s3cret@host:5672/vh")
    assert "s3cret" not in repr(settings) and "s3cret" not in settings.safe_broker_url
    assert redact_url("amqp://h/") == "amqp://h/"


@pytest.mark.parametrize(
    ("url", "vhost"), [("amqp://h//", "/"), ("amqp://h/", "/"), ("amqp://h/a%2Fb", "a/b")]
)
def test_vhost_is_read_as_kombu_reads_it(url, vhost):
    assert Settings(broker_url=url).virtual_host == vhost


def test_settings_from_env_and_validation():
    env = {
        "CLOCKWORK_BROKER_URL": "amqp://x:y@h//",
        "CLOCKWORK_SERIALIZER": "json",
        "CLOCKWORK_MAX_BODY_BYTES": "9",
    }
    settings = Settings.from_env(env)
    assert settings.serializer == "json" and settings.max_body_bytes == 9
    with pytest.raises(ConfigurationError):
        Settings.from_env({"CLOCKWORK_MAX_BODY_BYTES": "lots"})
    with pytest.raises(ConfigurationError):
        Settings(accept_content=("pickle",))
    with pytest.raises(ConfigurationError):
        Settings(broker_url="redis://h")


def test_the_legacy_namespace_keeps_every_name_of_earlier_releases():
    ns = topology.LEGACY_NAMESPACE
    assert Settings().namespace == ns == "celery"
    names = [
        topology.chord_join_queue(ns).name, topology.dependents_queue(ns).name,
        topology.dedup_gate_queue(3, ns).name, topology.task_states_stream(ns).name,
        topology.revocation_log(ns).name, topology.expired_queue(ns),
        topology.leader_queue("beat.default", ns).name, topology.beat_journal_stream("default", ns).name,
        topology.beat_snapshot_queue("default", ns).name, topology.beat_router_exchange("default", ns).name,
        topology.beat_term_exchange("default", ns, 7).name,
    ]  # fmt: skip
    assert names == [
        "clockwork.chords.celery", "clockwork.dependents.celery", "clockwork.dedup.celery.3",
        "clockwork.states.celery", "clockwork.revoked.celery", "clockwork.expired",
        "clockwork.leader.beat.default", "clockwork.beat.default.journal", "clockwork.beat.default.snapshot",
        "clockwork.beat.default.router", "clockwork.beat.default.term.7",
    ]  # fmt: skip


def test_an_app_namespace_keys_all_of_its_shared_state():
    settings = Settings(app_namespace="billing")
    ns = settings.namespace
    names = {
        topology.chord_join_queue(ns).name, topology.dependents_queue(ns).name,
        topology.dedup_gate_queue(0, ns).name, topology.task_states_stream(ns).name,
        topology.revocation_log(ns).name, topology.expired_queue(ns),
        topology.leader_queue("beat.default", ns).name,
        topology.beat_journal_stream("default", ns).name, topology.beat_snapshot_queue("default", ns).name,
        topology.beat_router_exchange("default", ns).name, topology.beat_term_exchange("default", ns, 1).name,
    }  # fmt: skip
    assert all(".billing." in name or name.endswith(".billing") for name in names), names
    # The control plane stays Celery's: `celery inspect` and Flower see every app's workers.
    assert topology.pidbox_exchange().name == "celery.pidbox"


@pytest.mark.parametrize("bad", ["", "has space", "a/b", "x" * 101])
def test_a_namespace_that_cannot_name_a_queue_is_refused(bad: str):
    with pytest.raises(ConfigurationError, match="app_namespace"):
        Settings(app_namespace=bad or " ")
    assert Settings.from_env({"CLOCKWORK_APP_NAMESPACE": "shop"}).namespace == "shop"
