"""Which app's worker ran which task, noted by the tasks of shop_app.py and billing_app.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support.json_lines import read_json_lines


def note_run(app: str, what: str) -> None:
    """Append ``[app, what]`` to ``$MANY_APPS_NOTES`` (one JSON line; appends of a line are atomic)."""
    path = os.environ.get("MANY_APPS_NOTES")
    if path:
        with open(path, "a") as notes:
            notes.write(json.dumps([app, what]) + "\n")


def read_notes(path: Path) -> list[tuple[str, str]]:
    """The notes so far, in order."""
    return [(str(app), str(what)) for app, what in read_json_lines(path)]
