"""Random uuid4 strings for task ids, from the OS's random source read in blocks.

``str(uuid.uuid4())`` reads 16 bytes with a system call of its own. In a client that enqueues,
that call releases the GIL to the connection's I/O thread, and taking it back was about a sixth of
the caller's time. Here the bytes come from one ``os.urandom`` read per ``_BLOCK_IDS`` ids; each id
is as random as ``uuid4``'s and formatted the same. The block is dropped in a forked child, so a
parent and its children never hand out the same ids.
"""

from __future__ import annotations

import os
import threading
from typing import Final

__all__ = ["uuid4_str"]

_BLOCK_IDS: Final = 256
_ID_BYTES: Final = 16
# Version 4 in the high nibble of byte 6, variant 10xx in the top bits of byte 8 (RFC 9562).
_VERSION_MASK: Final = ~(0xF000 << 64) & ((1 << 128) - 1)
_VERSION_4: Final = 0x4000 << 64
_VARIANT_MASK: Final = ~(0xC000 << 48) & ((1 << 128) - 1)
_VARIANT_RFC: Final = 0x8000 << 48

# Process-wide, as the OS random source it buffers. The lock makes taking an id's 16 bytes atomic
# (two threads must never read the same ones); it is replaced in a forked child, with the block.
_lock = threading.Lock()
_block = b""
_offset = 0


def uuid4_str() -> str:
    """A random (version 4) UUID in its 36-character form, like ``str(uuid.uuid4())``."""
    global _block, _offset
    with _lock:
        if _offset >= len(_block):
            _block = os.urandom(_BLOCK_IDS * _ID_BYTES)
            _offset = 0
        start = _offset
        _offset = start + _ID_BYTES
        raw = _block[start : start + _ID_BYTES]
    value = (int.from_bytes(raw, "big") & _VERSION_MASK & _VARIANT_MASK) | _VERSION_4 | _VARIANT_RFC
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _forget_block() -> None:
    global _lock, _block, _offset
    _lock, _block, _offset = threading.Lock(), b"", 0


os.register_at_fork(after_in_child=_forget_block)
