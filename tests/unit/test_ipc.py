"""The pool's frames through msgpack, and the guards on what a reader accepts."""

from __future__ import annotations

import msgpack
import pytest

from broker_svc.errors import DecodeError, MessageTooLarge
from worker.ipc import (
    HEADER,
    MAX_FRAME_BYTES,
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
