"""pika's ``SelectConnection`` with fewer socket writes: one per message, one per gathered batch.

pika hands each frame to its transport on its own (a message is three: method, header, body) and
the transport sends each with a ``send()`` of its own, which releases and retakes the GIL that the
caller's thread wants too. When enqueueing, those sends were the larger part of the I/O thread's
time. Here a message's frames go out as one buffer, and the frames marshaled inside
``gathered()`` (a drain of the outbox) as one buffer per ``_GATHER_BYTES``.

This overrides pika's ``Connection._output_marshaled_frames``, a private method (pika 1.x);
``tests/unit/test_gathering.py`` pins that it still exists, and the integration tests publish through it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final

import pika

__all__ = ["GatheringConnection"]

# A gathered batch goes to the transport whenever it reaches this size, so a drain of thousands of
# messages never builds one buffer of megabytes.
_GATHER_BYTES: Final = 128 * 1024


class GatheringConnection(pika.SelectConnection):  # type: ignore[misc]  # pika is untyped here
    """A ``SelectConnection`` whose writes are joined (see the module's docstring)."""

    _gathered: list[bytes] | None = None
    _gathered_bytes = 0

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Frames marshaled inside go out together when it ends (or every ``_GATHER_BYTES``)."""
        if self._gathered is not None:  # nested: the outer one flushes
            yield
            return
        self._gathered = []
        try:
            yield
        finally:
            self._flush_gathered()
            self._gathered = None

    def _output_marshaled_frames(self, marshaled_frames: Sequence[bytes]) -> None:
        data = marshaled_frames[0] if len(marshaled_frames) == 1 else b"".join(marshaled_frames)
        # pika's own bookkeeping (its heartbeat checker reads bytes_sent).
        self.bytes_sent += len(data)
        self.frames_sent += len(marshaled_frames)
        gathered = self._gathered
        if gathered is None:
            self._adapter_emit_data(data)
            return
        gathered.append(data)
        self._gathered_bytes += len(data)
        if self._gathered_bytes >= _GATHER_BYTES:
            self._flush_gathered()

    def _flush_gathered(self) -> None:
        parts, self._gathered = self._gathered, []
        self._gathered_bytes = 0
        # Marshaled frames of a connection that closed meanwhile are dropped, as pika drops what
        # its transport still buffered; unconfirmed messages are sent again on the next connection.
        if parts and not self.is_closed:
            self._adapter_emit_data(b"".join(parts))
