"""What the gathering connection sends (its private pika names are pinned in test_private_internals)."""

from __future__ import annotations

from broker_svc.connection.pika_internals import GatheringConnection


class _Recorder(GatheringConnection):
    """The override alone, with the transport replaced by a list (no socket, no ioloop)."""

    def __init__(self) -> None:  # pika's __init__ would connect
        self.bytes_sent = 0
        self.frames_sent = 0
        self.emitted: list[bytes] = []
        self._transport = None  # no plaintext transport: every write goes through the adapter

    def _adapter_emit_data(self, data: bytes) -> None:
        self.emitted.append(data)

    @property
    def is_closed(self) -> bool:
        return False


def test_a_message_goes_out_as_one_write_and_a_gathered_batch_as_one() -> None:
    conn = _Recorder()
    conn._output_marshaled_frames([b"method", b"header", b"body"])
    assert conn.emitted == [b"methodheaderbody"]
    with conn.gathered():
        for index in range(3):
            conn._output_marshaled_frames([b"m%d" % index, b"h", b"b"])
        assert len(conn.emitted) == 1  # nothing more until the batch ends
    assert conn.emitted[1] == b"m0hbm1hbm2hb"
    assert conn.frames_sent == 12
    assert conn.bytes_sent == len(b"methodheaderbody") + len(conn.emitted[1])


def test_a_large_batch_is_flushed_in_bounded_writes() -> None:
    conn = _Recorder()
    with conn.gathered():
        for _ in range(100):
            conn._output_marshaled_frames([b"x" * 4096])
    assert 1 < len(conn.emitted) <= 4
    assert b"".join(conn.emitted) == b"x" * 4096 * 100
