"""Signed control messages (control.protocol.signing): what passes, what is refused and why."""

from __future__ import annotations

from typing import Any

import pytest

from broker_svc.settings import Settings
from control.protocol.signing import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ControlSecurity,
    Refusal,
    login_of,
)

KEY = "s3cret-key"
BODY = b'{"method":"shutdown","arguments":{}}'


class FakeClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _signed(security: ControlSecurity, body: bytes = BODY, **headers: Any) -> dict[str, Any]:
    return security.sign(
        "request",
        exchange="celery.pidbox",
        body=body,
        content_type="application/json",
        content_encoding="utf-8",
        headers={"clock": 3, **headers},
    )


def _check(
    security: ControlSecurity,
    headers: dict[str, Any],
    body: bytes = BODY,
    user_id: str | None = "guest",
    **kw: Any,
) -> Refusal | None:
    return security.check(
        kw.get("kind", "request"),
        exchange=kw.get("exchange", "celery.pidbox"),
        body=body,
        content_type=kw.get("content_type", "application/json"),
        content_encoding="utf-8",
        headers=headers,
        user_id=user_id,
    )


def test_a_signed_request_passes_once_and_its_replay_is_refused():
    clock = FakeClock()
    sender, receiver = ControlSecurity(key=KEY, now=clock), ControlSecurity(key=KEY, now=clock)
    headers = _signed(sender)
    assert {SIGNATURE_HEADER, TIMESTAMP_HEADER, NONCE_HEADER} <= headers.keys()
    assert _check(receiver, headers) is None
    assert _check(receiver, headers) is Refusal.REPLAYED


def test_unsigned_and_wrong_key_messages_are_refused():
    receiver = ControlSecurity(key=KEY)
    assert _check(receiver, {"clock": 3}) is Refusal.UNSIGNED
    assert _check(receiver, _signed(ControlSecurity(key="another-key"))) is Refusal.BAD_SIGNATURE


@pytest.mark.parametrize(
    "change",
    [
        {"body": b'{"method":"ping","arguments":{}}'},
        {"exchange": "other.pidbox"},
        {"content_type": "application/x-msgpack"},
        {"kind": "reply"},
        {"headers": {"clock": 4}},
        {"headers": {"ticket": "t2"}},
        {"headers": {"x-clockwork-logged": True}},
        {"headers": {TIMESTAMP_HEADER: "1800000001.000"}},
    ],
)
def test_changing_anything_signed_breaks_the_signature(change: dict[str, Any]):
    clock = FakeClock()
    headers = _signed(ControlSecurity(key=KEY, now=clock))
    receiver = ControlSecurity(key=KEY, now=clock)
    body = change.pop("body", BODY)
    headers = {**headers, **change.pop("headers", {})}
    assert _check(receiver, headers, body, **change) is Refusal.BAD_SIGNATURE


@pytest.mark.parametrize("skew", [-61.0, 61.0])
def test_timestamps_outside_the_window_are_stale(skew: float):
    clock = FakeClock()
    headers = _signed(ControlSecurity(key=KEY, now=clock))
    clock.now += skew
    assert _check(ControlSecurity(key=KEY, now=clock), headers) is Refusal.STALE


def test_a_full_nonce_cache_refuses_anything_as_old_as_what_it_dropped():
    clock = FakeClock()
    sender, receiver = ControlSecurity(key=KEY, now=clock), ControlSecurity(key=KEY, now=clock, max_nonces=2)
    first = _signed(sender)
    clock.now += 1
    second, third = _signed(sender), _signed(sender)
    assert [_check(receiver, h) for h in (first, second, third)] == [None, None, None]
    # ``first`` was dropped to make room: replaying it is still refused (its time is past the floor).
    assert _check(receiver, first) is Refusal.STALE
    assert _check(receiver, second) is Refusal.REPLAYED


def test_expired_nonces_are_forgotten_so_the_cache_stays_small():
    clock = FakeClock()
    sender, receiver = ControlSecurity(key=KEY, now=clock), ControlSecurity(key=KEY, now=clock)
    for _ in range(100):
        assert _check(receiver, _signed(sender)) is None
        clock.now += 1
    assert len(receiver._nonces) <= 62


def test_the_allow_list_refuses_requests_from_missing_or_other_users_but_not_replies():
    security = ControlSecurity(allowed_users=["ops"])
    assert _check(security, {}, user_id=None) is Refusal.NO_USER_ID
    assert _check(security, {}, user_id="producer") is Refusal.USER_NOT_ALLOWED
    assert _check(security, {}, user_id="ops") is None
    assert _check(security, {}, user_id="worker", kind="reply") is None


def test_without_key_or_allow_list_everything_passes_and_nothing_is_added():
    security = ControlSecurity()
    assert _signed(security) == {"clock": 3}
    assert _check(security, {}, user_id=None) is None


def test_the_key_comes_from_the_environment_and_never_shows_in_reprs():
    settings = Settings.from_env(
        {
            "CLOCKWORK_BROKER_URL": "amqp://ops%40x:pw@h:5672/v",
            "CLOCKWORK_CONTROL_KEY": KEY,
            "CLOCKWORK_CONTROL_USERS": "ops@x, admin ,",
        }
    )
    assert settings.control_signing_key == KEY
    assert settings.control_allowed_users == ("ops@x", "admin")
    security = ControlSecurity.from_settings(settings)
    assert security.signing and security.user_id == "ops@x"
    assert KEY not in repr(settings) and KEY not in repr(security)


def test_login_of_reads_the_user_of_the_url():
    assert login_of("amqp://guest:guest@127.0.0.1:5672//") == "guest"
    assert login_of("amqp://127.0.0.1//") is None


def test_an_empty_key_is_a_configuration_mistake():
    with pytest.raises(ValueError, match="must not be empty"):
        ControlSecurity(key="")


def test_a_message_signed_before_the_receiver_started_is_stale():
    # A worker restarted within the window has an empty nonce cache: what was signed for its
    # previous life must not be replayed at it.
    clock = FakeClock()
    headers = _signed(ControlSecurity(key=KEY, now=clock))
    clock.now += 1
    assert _check(ControlSecurity(key=KEY, now=clock), headers) is Refusal.STALE
