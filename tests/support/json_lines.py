"""Reading a JSON-lines file that other processes are still appending to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_lines(path: str | Path) -> list[Any]:
    """The file's complete lines, decoded, in order; [] if it does not exist yet.

    A line another process is still writing has no newline yet: it is read on the next call (a
    reader met one mid-write in a full run).
    """
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
