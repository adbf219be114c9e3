"""Our chord counting and Celery's, interleaved on one chord in a real Redis: one count, one claim.

A mixed fleet joins a chord only if both kinds of worker count it identically. Celery's own
``RedisBackend.on_chord_part_return`` (for parts that do not complete the chord, so it sends
nothing) and our ``ChordCounter`` take turns on the same keys of the session's private Redis.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery

from broker_svc.redis_results.backend_conf import RedisBackendConf
from broker_svc.redis_results.chords import ChordCounter
from broker_svc.redis_results.connection import open_client
from broker_svc.redis_results.writer import ResultWriter
from broker_svc.settings import Settings
from broker_svc.wire.results.message import wire_exception
from tests.interop.conftest import close_celery_client


@pytest.fixture
def celery_backend(redis_url: str) -> Iterator[Any]:
    app = Celery("counting", broker="memory://", backend=redis_url)
    yield app.backend
    close_celery_client(app)


@pytest.fixture
def counter(redis_url: str) -> Iterator[ChordCounter]:
    conf = RedisBackendConf.of({"result_backend": redis_url}, Settings())
    assert conf is not None
    client = open_client(redis_url)
    yield ChordCounter(ResultWriter(client, conf))
    client.close()


def celery_part(
    backend: Any, group_id: str, index: int, task_id: str, value: Any, state: str = "SUCCESS"
) -> None:
    request = SimpleNamespace(
        id=task_id, group=group_id, group_index=index, chord={"task": "body", "options": {}}
    )
    backend.on_chord_part_return(request, state, value)


def test_parts_counted_by_celery_and_by_us_make_one_count_and_one_claim(
    celery_backend: Any, counter: ChordCounter, redis_url: str
):
    celery_backend.set_chord_size("g1", 4)  # as Celery's client does before the last header task
    celery_part(celery_backend, "g1", 0, "t0", 10)
    assert counter.part_return("g1", "t1", 1, "SUCCESS", 11) is None
    assert counter.part_return("g1", "t1", 1, "SUCCESS", 11) is None  # a run again counts once
    celery_part(celery_backend, "g1", 2, "t2", 12)
    celery_part(celery_backend, "g1", 2, "t2", 12)  # Celery's copy counts once too
    claim = counter.part_return("g1", "t3", 3, "SUCCESS", 13)
    assert claim is not None and claim.total == 4
    # The header's results in its order, Celery's entries and ours alike.
    assert counter.results(claim) == [[1, "t0", "SUCCESS", 10], [1, "t1", "SUCCESS", 11],
                                      [1, "t2", "SUCCESS", 12], [1, "t3", "SUCCESS", 13]]  # fmt: skip
    # Celery decodes our entries as its own.
    store = redis.Redis.from_url(redis_url)
    try:
        raw = store.zrange("celery-taskset-meta-g1.j", 0, -1)
        assert [celery_backend._unpack_chord_result(entry, celery_backend.decode) for entry in raw] == [
            10,
            11,
            12,
            13,
        ]
        assert counter.extend(claim, 60) and counter.cleanup(claim)
        assert store.get("celery-taskset-meta-g1.c") == b"done"
        assert store.exists("celery-taskset-meta-g1.j", "celery-taskset-meta-g1.s") == 0
    finally:
        store.close()
    # A late copy after the chord is done changes nothing, on either side.
    assert counter.part_return("g1", "t3", 3, "SUCCESS", 13) is None
    celery_part(celery_backend, "g1", 0, "t0", 10)
    assert counter._client.exists("celery-taskset-meta-g1.j") == 0


def test_a_claim_held_by_one_worker_is_not_taken_by_another_until_released(
    celery_backend: Any, counter: ChordCounter
):
    celery_backend.set_chord_size("g2", 1)
    claim = counter.part_return(
        "g2", "t0", 0, "FAILURE", wire_exception("ValueError", "x", module="builtins")
    )
    assert claim is not None
    assert counter.part_return("g2", "t0", 0, "FAILURE", {}) is None  # its copy: claimed already
    counter.release(claim)  # the body was not sent: the task's next run claims it again
    again = counter.part_return("g2", "t0", 0, "FAILURE", {})
    assert again is not None and again.token != claim.token
    assert counter.results(again)[0][2] == "FAILURE"
