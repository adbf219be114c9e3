"""The pool's frames: jobs and outcomes through msgpack, and the guards on what a reader accepts."""

from __future__ import annotations

import signal

import msgpack
import pytest

from broker_svc.errors import DecodeError, MessageTooLarge
from worker.pool.ipc import (
    HEADER,
    MAX_FRAME_BYTES,
    Job,
    JobOutcome,
    JobStatus,
    decode_frame,
    describe_exit,
    encode_frame,
    frame_length,
)


def split(data: bytes) -> bytes:
    length = frame_length(data[: HEADER.size])
    body = data[HEADER.size :]
    assert len(body) == length
    return body


def test_a_job_survives_the_run_frame() -> None:
    job = Job("id-1", "proj.add", [1, b"\x00", None], {"k": [1.5]}, {"retries": 2}, 10.0, 5)
    frame = decode_frame(split(encode_frame(job.to_frame())))
    assert frame["op"] == "run"
    assert Job.from_frame(frame) == Job(
        "id-1", "proj.add", [1, b"\x00", None], {"k": [1.5]}, {"retries": 2}, 10.0, 5.0
    )


def test_a_malformed_run_frame_is_a_decode_error() -> None:
    good = Job("id-1", "proj.add", [], {}, {}).to_frame()
    for broken in (
        {**good, "op": "done"},
        {**good, "args": {}},
        {**good, "task_id": 3},
        {**good, "soft_time_limit_s": "1"},
    ):
        with pytest.raises(DecodeError):
            Job.from_frame(broken)


def test_a_done_frame_becomes_an_outcome_and_only_success_or_failure_is_accepted() -> None:
    frame = {"op": "done", "status": "FAILURE", "value": None, "error": {"exc_type": "X"}, "traceback": "tb"}
    outcome = JobOutcome.from_frame({**frame, "runtime_s": 0.25}, pid=42)
    assert outcome == JobOutcome(JobStatus.FAILURE, None, {"exc_type": "X"}, "tb", 0.25, 42)
    for status in ("LOST", "TIME_LIMIT", "bogus", None):
        with pytest.raises(DecodeError):
            JobOutcome.from_frame({**frame, "status": status}, pid=42)
    with pytest.raises(DecodeError):
        JobOutcome.from_frame({**frame, "error": "not a map"}, pid=42)


def test_dead_child_outcomes_carry_celerys_errors() -> None:
    job = Job("id-1", "proj.sleep", [], {}, {}, hard_time_limit_s=2.5)
    lost = JobOutcome.for_dead_child(job, None, exitcode=-signal.SIGKILL, runtime_s=1.0, pid=7)
    assert lost.status == JobStatus.LOST
    assert lost.error == {
        "exc_type": "WorkerLostError",
        "exc_message": ["Worker exited prematurely: signal 9 (SIGKILL)."],
        "exc_module": "billiard.exceptions",
    }
    limit = JobOutcome.for_dead_child(job, JobStatus.TIME_LIMIT, exitcode=-9, runtime_s=2.5, pid=7)
    assert limit.error == {
        "exc_type": "TimeLimitExceeded",
        "exc_message": [2.5],
        "exc_module": "celery.exceptions",
    }
    revoked = JobOutcome.for_dead_child(job, JobStatus.TERMINATED, exitcode=-15, runtime_s=0.1, pid=7)
    assert revoked.error is not None and revoked.error["exc_type"] == "TaskRevokedError"


def test_exit_statuses_are_worded_as_celery_does() -> None:
    assert describe_exit(3) == "exitcode 3"
    assert describe_exit(-15) == "signal 15 (SIGTERM)"
    assert describe_exit(None) == "exitcode None"


def test_what_msgpack_cannot_carry_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="msgpack cannot encode"):
        encode_frame({"op": "done", "value": object()})
    with pytest.raises(TypeError):
        encode_frame({"op": "done", "value": 2**70})


def test_a_reader_refuses_absurd_lengths_and_non_frames() -> None:
    with pytest.raises(MessageTooLarge):
        frame_length(HEADER.pack(MAX_FRAME_BYTES + 1))
    for body in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"op": 1}), b""):
        with pytest.raises(DecodeError):
            decode_frame(body)
