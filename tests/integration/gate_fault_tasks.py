"""The keyed-dedup tasks, run by a worker whose main process dies the moment a transaction commits.

With ``CLOCKWORK_TEST_KILL_AFTER_COMMIT`` naming a file, the worker's main process (where the
dedup gate decides) wraps aiormq's ``tx_commit``: once a commit has returned, if the file exists,
it deletes it and SIGKILLs itself before anything else runs. The test creates the file to arm it:
the next commit is the last, and whatever the gate does after committing is never done. The
commit itself is the real one; pool children never import aiormq, so they are untouched.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

from tests.integration.dedup_tasks import app

__all__ = ["KILL_AFTER_COMMIT_ENV", "app"]

KILL_AFTER_COMMIT_ENV = "CLOCKWORK_TEST_KILL_AFTER_COMMIT"


def _arm(path: Path) -> None:
    import aiormq  # the worker's main process has it

    commit = aiormq.Channel.tx_commit

    async def tx_commit(self: aiormq.Channel, *args: Any, **kwargs: Any) -> Any:
        result = await commit(self, *args, **kwargs)
        try:
            os.unlink(path)  # synchronous on purpose: nothing else may run before the kill
        except FileNotFoundError:
            return result
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    aiormq.Channel.tx_commit = tx_commit  # type: ignore[method-assign]


_path = os.environ.get(KILL_AFTER_COMMIT_ENV)
if _path and multiprocessing.parent_process() is None:  # the main process, not a pool child
    _arm(Path(_path))
