"""Bad input on the task path (R20–R23): dead-lettered with a reason, never run, never a crash.

tests/integration/test_bad_input.py checks every refusal reason one by one; here the same paths
run against a spy (R20), at fuzzing volume (R21), and with the figures the matrix asks for.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from broker_svc import App, LamportClock, Publisher, Settings
from broker_svc.connection.pending import PendingPublish
from broker_svc.errors import MessageError
from broker_svc.topology import DEFAULT_EXCHANGE, task_queue
from broker_svc.wire import codec
from broker_svc.wire.task.task_message import WireMessage, decode_task
from tests.reliability.delivery_tasks import PICKLE_SPY_ENV
from tests.reliability.journal import SIZES, Journal, report
from tests.support.amqp import channel, delete_queues, drain, publish_raw, queue_depth
from tests.support.waiting import wait_for
from tests.support.workers import ROOT, WorkerProcess, unique_queue

APP = "tests.reliability.delivery_tasks:app"
MAX_BODY = 1 << 20  # the fuzzed worker's max_body_bytes: "huge" bodies go up to it and just over
ACCEPT = codec.accept_set(["json", "msgpack"])


@pytest.fixture
def bad_queue(test_vhost_url: str) -> Iterator[str]:
    name = unique_queue("bad")
    yield name
    delete_queues(test_vhost_url, name, f"{name}.dead")


def _decode_result(body: bytes, content_type: str | None) -> dict[str, Any]:
    value = codec.decode(body, content_type, accept=ACCEPT, max_bytes=1 << 20)
    assert isinstance(value, dict)
    return value


# -- R20 / R22: disallowed content types and unknown tasks ---------------------------------------


def test_the_pickle_spy_would_see_a_pickle_loads(tmp_path: Path):
    # The spy the next test relies on is armed: importing the app module plants it.
    marker = tmp_path / "spy"
    code = "import pickle, tests.reliability.delivery_tasks; pickle.loads(pickle.dumps(1))"
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, PICKLE_SPY_ENV: str(marker)}, check=True
    )
    assert "pickle.loads called" in marker.read_text()


def test_disallowed_content_and_unknown_tasks_are_dead_lettered_unread(
    test_vhost_url: str, bad_queue: str, tmp_path: Path
):
    queue = bad_queue
    marker = tmp_path / "pickle-spy"
    reply = f"reply-{uuid.uuid4().hex[:8]}"
    with channel(test_vhost_url) as ch:
        ch.queue_declare(reply, auto_delete=False)
    env = {PICKLE_SPY_ENV: str(marker)}
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=1, env=env) as worker:
        worker.wait_ready()
        started = time.monotonic()
        disallowed = {
            "application/x-python-serialize": pickle.dumps([["boom"], {}, {}]),
            "application/x-yaml": b"- [1]\n- {}\n",
            "application/x-bson": b"\x05\x00\x00\x00\x00",
            None: b"[[],{},{}]",
        }
        for i, (content_type, body) in enumerate(disallowed.items()):
            publish_raw(
                test_vhost_url, queue, body,
                headers={"task": "journal.noop", "id": f"r20-{i}"}, content_type=content_type, reply_to=reply,
            )  # fmt: skip
        unknown = 3
        for i in range(unknown):
            publish_raw(
                test_vhost_url, queue, json.dumps([[], {}, None]).encode(),
                headers={"task": "nope.nope", "id": f"r22-{i}"}, reply_to=reply,
            )  # fmt: skip
        dead: list = []

        def all_dead() -> bool:
            dead.extend(drain(test_vhost_url, f"{queue}.dead"))
            return len(dead) >= len(disallowed) + unknown

        wait_for(all_dead, timeout_s=30, message=f"dead letters: {len(dead)}")
        to_dlq_s = time.monotonic() - started
        results: dict[str, dict[str, Any]] = {}

        def all_answered() -> bool:
            for m in drain(test_vhost_url, reply):
                result = _decode_result(m.body, m.properties.content_type)
                results[result["task_id"]] = result
            return len(results) >= len(disallowed) + unknown

        wait_for(all_answered, timeout_s=30, message=f"results: {sorted(results)}")
        alive = worker.proc.poll() is None
        reasons = Counter(d.headers["x-clockwork-reason"] for d in dead)
        report(
            "R20",
            None,
            dlq_count=reasons["ContentDisallowed"],
            published=len(disallowed),
            pickle_loads_calls=len(marker.read_text().splitlines()) if marker.exists() else 0,
            worker_alive=alive,
            seconds_until_dlq=round(to_dlq_s, 2),
        )
        report("R22", None, dlq_count=reasons["NotRegistered"], published=unknown)
        assert not marker.exists(), marker.read_text()  # never unpickled
        assert reasons == {"ContentDisallowed": len(disallowed), "NotRegistered": unknown}
        assert alive
        pickled = next(d for d in dead if d.headers["id"] == "r20-0")
        assert pickled.body == disallowed["application/x-python-serialize"]  # kept as sent, for a look
        for i in range(len(disallowed)):
            assert results[f"r20-{i}"]["status"] == "FAILURE"
            assert results[f"r20-{i}"]["result"]["exc_type"] == "ContentDisallowed"
        for i in range(unknown):
            assert results[f"r22-{i}"]["result"]["exc_type"] == "NotRegistered"
    delete_queues(test_vhost_url, reply)


# -- R23: a task that keeps raising ---------------------------------------------------------------


def test_a_task_that_keeps_raising_is_retried_with_backoff_then_dead_lettered(
    test_vhost_url: str, bad_queue: str, tmp_path: Path
):
    queue = bad_queue
    log = tmp_path / "attempts"
    journal = Journal(tmp_path / "journal")
    client = App("r23", settings=Settings(broker_url=test_vhost_url))
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=1, env=journal.env) as worker:
        worker.wait_ready()
        states: list[str] = []
        started = time.monotonic()
        result = client.send_task("journal.always_fails", (str(log),), queue=queue)
        with pytest.raises(ValueError, match="attempt 3"):
            result.get(timeout=60, on_message=lambda body: states.append(body["status"]))
        dead = wait_for(
            lambda: drain(test_vhost_url, f"{queue}.dead"), timeout_s=20, message="no dead letter"
        )
        to_dlq_s = time.monotonic() - started
        attempts = [line.split() for line in log.read_text().splitlines()]
        times = [float(at) for _, at in attempts]
        gaps = [round(b - a, 3) for a, b in zip(times, times[1:], strict=False)]
        report(
            "R23",
            None,
            attempts=len(attempts),
            max_retries=3,
            backoff_gaps_s=gaps,
            expected_gaps_s=[0.2, 0.4, 0.8],
            seconds_until_dlq=round(to_dlq_s, 2),
            dlq_reason=dead[0].headers.get("x-clockwork-reason"),
            worker_retried_events=worker.count("task_retried"),
        )
        assert [int(n) for n, _ in attempts] == [0, 1, 2, 3]  # 1 run + max_retries, no more
        assert states == ["RETRY", "RETRY", "RETRY", "FAILURE"]
        for gap, expected in zip(gaps, [0.2, 0.4, 0.8], strict=True):
            assert expected <= gap < expected + 1.5, gaps  # never early; late only by scheduling
        assert len(dead) == 1 and dead[0].headers["x-clockwork-reason"] == "max_retries_exceeded"
        assert dead[0].headers["retries"] == 3
        assert queue_depth(test_vhost_url, queue) == 0  # no loop: nothing left to run
    client.close(timeout=10)


# -- R21: fuzzed bodies ---------------------------------------------------------------------------

_MSGPACK, _JSON = codec.MSGPACK, codec.JSON

_int = st.integers(-(2**63), 2**63 - 1)  # what both codecs carry
_leaf = st.one_of(st.none(), st.booleans(), _int, st.floats(allow_nan=False), st.text(max_size=20))
_value = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_valid_payload = st.tuples(
    st.lists(_value, max_size=4), st.dictionaries(st.text(max_size=8), _value, max_size=4), st.none()
)


def _pack(value: Any, content_type: str) -> bytes:
    if content_type == _MSGPACK:
        return bytes(msgpack.packb(value, use_bin_type=True))
    return json.dumps(value).encode()


@st.composite
def _truncated(draw: st.DrawFn) -> tuple[bytes, str]:
    content_type = draw(st.sampled_from([_MSGPACK, _JSON]))
    body = _pack(list(draw(_valid_payload)), content_type)
    return body[: draw(st.integers(0, len(body) - 1))], content_type


_not_a_list = st.one_of(
    st.none(), _int, st.text(max_size=10), st.dictionaries(st.text(max_size=4), _leaf, max_size=3)
)
_not_a_dict = st.one_of(st.none(), _int, st.text(max_size=10), st.lists(_leaf, max_size=3))
_schema_breaking = st.one_of(
    st.tuples(_not_a_list, st.dictionaries(st.text(max_size=4), _leaf, max_size=2), st.none()).map(
        list
    ),  # args
    st.tuples(st.lists(_leaf, max_size=2), _not_a_dict, st.none()).map(list),  # kwargs
    st.tuples(
        st.lists(_leaf, max_size=2), st.dictionaries(_int, _leaf, min_size=1, max_size=2), st.none()
    ).map(list),  # fmt: skip
    st.tuples(st.lists(_leaf, max_size=2), st.just({}), _int | st.text(max_size=4)).map(list),  # embed
    st.lists(_leaf, max_size=2),  # the wrong length
    st.lists(_leaf, min_size=4, max_size=6),
    st.dictionaries(st.text(max_size=8), _value, max_size=4),  # not an array at all
    _leaf,
)


@st.composite
def _special(draw: st.DrawFn) -> tuple[bytes, str]:
    content_type = draw(st.sampled_from([_MSGPACK, _JSON]))
    kind = draw(st.sampled_from(["deep", "bigint", "ext", "huge"]))
    if kind == "deep":  # nesting depth 10^4
        depth = 10_000
        if content_type == _MSGPACK:
            return b"\x91" * depth + b"\xc0", content_type
        return b"[" * depth + b"]" * depth, content_type
    if kind == "bigint":  # 2^100: json carries it; msgpack cannot, so a uint64 prefix with junk
        if content_type == _MSGPACK:
            return b"\x93\xcf" + (2**64 - 1).to_bytes(8, "big") + b"\xff\xff", content_type
        return json.dumps(
            draw(st.sampled_from([[2**100, {}, None], [[], {"a": 1}, 2**100], 2**100]))
        ).encode(), content_type
    if kind == "ext":  # msgpack ext types are refused by the decoder (no ext_hook)
        ext = msgpack.ExtType(draw(st.integers(0, 127)), draw(st.binary(max_size=16)))
        return bytes(msgpack.packb([[ext], {}, None])), _MSGPACK
    size = draw(st.sampled_from([1 << 12, 1 << 16, MAX_BODY - 64, MAX_BODY + 1]))  # a huge string
    return _pack(["x" * size, {}, None], content_type), content_type


def _bodies() -> st.SearchStrategy[tuple[bytes, str]]:
    content_type = st.sampled_from([_MSGPACK, _JSON])
    return st.one_of(
        st.tuples(st.binary(max_size=256), content_type),
        _truncated(),
        st.tuples(_schema_breaking, content_type).map(lambda pair: (_pack(pair[0], pair[1]), pair[1])),
        _special(),
    )


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext type")


def _schema_valid(body: bytes, content_type: str) -> bool:
    # The oracle is the protocol, not our decoder: a 3-array of (list, map of str keys, None or map).
    try:
        if content_type == _MSGPACK:  # no ext types in the protocol: one anywhere makes it invalid
            value = msgpack.unpackb(body, raw=False, strict_map_key=False, ext_hook=_no_ext)
        else:
            value = json.loads(body)
    except Exception:
        return False
    return (
        isinstance(value, list) and len(value) == 3 and isinstance(value[0], list)
        and isinstance(value[1], dict) and all(isinstance(k, str) for k in value[1])
        and (value[2] is None or isinstance(value[2], dict))
    )  # fmt: skip


def generate_bodies(n: int) -> list[tuple[bytes, str]]:
    """``n`` bad bodies from Hypothesis, the same ones on every run (derandomized)."""
    found: list[tuple[bytes, str]] = []

    @settings(
        max_examples=n + n // 10 + 50,  # schema-valid draws are rare: a little headroom for them
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_bodies())
    def collect(pair: tuple[bytes, str]) -> None:
        if len(found) < n and not _schema_valid(*pair):
            found.append(pair)

    collect()
    assert len(found) == n, f"Hypothesis gave {len(found)} bad bodies, wanted {n}"
    return found


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


@pytest.mark.timeout(900)  # 10,000 bodies take minutes to generate (chaos only)
@pytest.mark.parametrize("n", SIZES)
def test_fuzzed_bodies_all_go_to_the_dead_letter_queue(test_vhost_url: str, bad_queue: str, n: int):
    queue = bad_queue
    bodies = generate_bodies(n)
    kinds = Counter(ctype for _, ctype in bodies)
    env = {"CLOCKWORK_MAX_BODY_BYTES": str(MAX_BODY)}
    with WorkerProcess(test_vhost_url, app=APP, queues=[queue], concurrency=1, env=env) as worker:
        worker.wait_ready()
        pid = worker.pid
        rss_before_kib = _rss_kib(pid, "VmRSS")
        started = time.monotonic()
        wires = [
            WireMessage(
                body=body,
                content_type=ctype,
                content_encoding="binary" if ctype == _MSGPACK else "utf-8",
                headers={"task": "journal.noop", "id": f"fuzz-{i}"},
            )
            for i, (body, ctype) in enumerate(bodies)
        ]
        # Pipelined confirms through the library's own publisher: raw bytes, no encoding on our side.
        with Publisher(Settings(broker_url=test_vhost_url), clock=LamportClock(), name="fuzzer") as publisher:
            publisher.submit(
                [
                    PendingPublish(
                        w, exchange=DEFAULT_EXCHANGE, routing_key=queue, declare=(task_queue(queue),)
                    )
                    for w in wires
                ]
            )
            publisher.flush(timeout=120)
        published_s = time.monotonic() - started
        dead: dict[str, Any] = {}
        peak_seen = [0]

        def all_dead() -> bool:
            peak_seen[0] = max(peak_seen[0], _rss_kib(pid, "VmHWM"))
            for letter in drain(test_vhost_url, f"{queue}.dead"):
                dead[letter.headers["id"]] = letter
            return len(dead) >= n

        wait_for(all_dead, timeout_s=60 + n / 50, interval_s=0.2, message=f"{len(dead)} of {n} dead-lettered")
        all_dead_s = time.monotonic() - started
        alive = worker.proc.poll() is None
        peak_kib = _rss_kib(pid, "VmHWM")
        crashes = worker.count("delivery_failed")
        recounted = sum(1 for d in dead.values() if "x-clockwork-deliveries" in d.headers or d.redelivered)
        reasons = Counter(d.headers["x-clockwork-reason"] for d in dead.values())
    # The same decoder, timed here: what the worker spends per body before it refuses it.
    times = []
    for body, ctype in bodies:
        t0 = time.perf_counter()
        try:
            decode_task(
                body,
                {"task": "journal.noop", "id": "x"},
                content_type=ctype,
                accept=ACCEPT,
                max_bytes=MAX_BODY,
            )
        except MessageError:
            pass
        times.append(time.perf_counter() - t0)
    times.sort()
    report(
        "R21",
        None,
        n=n,
        msgpack_bodies=kinds[_MSGPACK],
        json_bodies=kinds[_JSON],
        dlq_count=len(dead),
        crashes=crashes + (0 if alive else 1),
        redeliveries=recounted,
        reasons=dict(reasons),
        worker_rss_before_mib=round(rss_before_kib / 1024, 1),
        worker_peak_rss_mib=round(peak_kib / 1024, 1),
        publish_s=round(published_s, 2),
        seconds_until_all_dead=round(all_dead_s, 2),
        decode_p99_ms=round(times[math.ceil(0.99 * len(times)) - 1] * 1000, 3),
        decode_max_ms=round(times[-1] * 1000, 3),
    )
    assert len(dead) == n and set(dead) == {f"fuzz-{i}" for i in range(n)}
    assert alive and crashes == 0
    assert recounted == 0  # each refused on its first delivery
    assert set(reasons) <= {"DecodeError", "InvalidTaskMessage", "MessageTooLarge"}
    assert queue_depth(test_vhost_url, queue) == 0
    # Bounded: the worker holds one delivery at a time (prefetch 1), whatever the volume.
    assert peak_kib - rss_before_kib < 150 * 1024, (rss_before_kib, peak_kib)
