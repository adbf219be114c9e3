"""Headless Chromium for tests: screenshot a page, dump its rendered DOM, and check a PNG is not blank."""

from __future__ import annotations

import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

# Debian's package; `make test` installs it (the `chromium` target). Missing means fail, never skip.
CHROMIUM = "chromium"
_MISSING = (
    "chromium is not on PATH: the Flower screenshot test needs Debian's chromium. "
    "Run `make chromium` (apt-get install -y --no-install-recommends chromium)."
)


def _chromium() -> str:
    path = shutil.which(CHROMIUM)
    if path is None:
        raise AssertionError(_MISSING)
    return path


def _run(args: list[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # A fresh profile per run: two chromiums never fight over a profile lock, and nothing is left behind.
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = [
            _chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--no-default-browser-check", "--hide-scrollbars", f"--user-data-dir={profile}",
            *args,
        ]  # fmt: skip
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"chromium did not finish within {timeout_s:g} s: {cmd}") from exc


def screenshot(
    url: str,
    path: Path,
    *,
    width: int = 1280,
    height: int = 800,
    timeout_s: float = 30.0,
    budget_ms: int = 3000,
) -> Path:
    """Render ``url`` in headless Chromium and save a PNG of the window.

    Args:
        url: The page to load.
        path: Where to write the PNG.
        width: Window width in pixels.
        height: Window height in pixels.
        timeout_s: Kill chromium and fail after this long.
        budget_ms: Virtual time the page gets to run its scripts (XHRs, table rendering) first.

    Returns:
        ``path``, now a PNG file.

    Raises:
        AssertionError: chromium is missing, hung, or wrote no PNG.
    """
    path.unlink(missing_ok=True)
    out = _run(
        [
            f"--screenshot={path}",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={budget_ms}",
            url,
        ],
        timeout_s=timeout_s,
    )
    if not path.is_file():
        raise AssertionError(f"chromium wrote no screenshot (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return path


def dump_dom(url: str, *, timeout_s: float = 30.0, budget_ms: int = 3000) -> str:
    """The page's DOM as serialized HTML after its scripts ran for ``budget_ms`` of virtual time.

    Raises:
        AssertionError: chromium is missing, hung, or printed nothing.
    """
    out = _run([f"--virtual-time-budget={budget_ms}", "--dump-dom", url], timeout_s=timeout_s)
    if not out.stdout.strip():
        raise AssertionError(f"chromium dumped no DOM (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


@dataclass(frozen=True)
class PngSummary:
    width: int
    height: int
    distinct_pixels: int  # distinct RGB(A) values, over a sample of rows


def summarize_png(path: Path, *, sample_rows: int = 200) -> PngSummary:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) far enough to count its distinct colours.

    Raises:
        AssertionError: not a PNG of that kind.
    """
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise AssertionError(f"{path} is not a PNG")
    pos, idat, header = 8, bytearray(), b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header)
    channels = {2: 3, 6: 4}.get(colour)
    if depth != 8 or channels is None or interlace:
        raise AssertionError(f"{path}: unexpected PNG format (depth {depth}, colour {colour})")
    raw = zlib.decompress(bytes(idat))
    stride = width * channels
    colours: set[bytes] = set()
    previous = bytearray(stride)
    step = max(1, height // sample_rows)
    for row in range(height):
        line = _unfilter(raw[row * (stride + 1)], raw[row * (stride + 1) + 1 : (row + 1) * (stride + 1)],
                         previous, channels)  # fmt: skip
        if row % step == 0:
            colours.update(bytes(line[i : i + channels]) for i in range(0, stride, channels))
        previous = line
    return PngSummary(width, height, len(colours))


def _unfilter(kind: int, line: bytes, previous: bytearray, bpp: int) -> bytearray:
    out = bytearray(line)
    for i in range(len(out)):
        left = out[i - bpp] if i >= bpp else 0
        up = previous[i]
        up_left = previous[i - bpp] if i >= bpp else 0
        if kind == 1:
            out[i] = (out[i] + left) & 0xFF
        elif kind == 2:
            out[i] = (out[i] + up) & 0xFF
        elif kind == 3:
            out[i] = (out[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            p = left + up - up_left
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else up_left
            out[i] = (out[i] + pred) & 0xFF
    return out
