"""The task the keyed-dedup stress runs (K1, K2): it journals when each run of a key starts and ends.

Each process appends to a file of its own (``<pid>.jsonl`` under ``$CLOCKWORK_DEDUP_JOURNAL_DIR``),
one ``write(2)`` per line, so lines never interleave and a kill leaves at most a cut last line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from broker_svc import App, Task

JOURNAL_DIR_ENV = "CLOCKWORK_DEDUP_JOURNAL_DIR"
TASK = "dedup_stress.touch"

app = App("dedup-stress")


def note(event: str, key: str, task_id: str, **fields: object) -> None:
    """Append one line (``event`` is ``start`` or ``end``) to this process's journal."""
    directory = os.environ.get(JOURNAL_DIR_ENV)
    if not directory:
        raise RuntimeError(f"the dedup stress task ran without ${JOURNAL_DIR_ENV}")
    pid = os.getpid()
    line = {"event": event, "key": key, "id": task_id, "pid": pid, "at": time.time(), **fields}
    fd = os.open(Path(directory) / f"{pid}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


@app.task(bind=True, name=TASK)
def touch(self: Task, key: str, work_ms: int) -> str:
    """Stands for a refresh of ``key`` that takes ``work_ms`` milliseconds."""
    task_id = str(self.request.id)
    redelivered = bool((self.request.delivery_info or {}).get("redelivered"))
    note("start", key, task_id, redelivered=redelivered)
    time.sleep(work_ms / 1000)
    note("end", key, task_id)
    return task_id
