"""``configure_logging(defer=True)`` (what ``ctl`` uses): structlog is loaded only when a line is
written, and that line comes out as it would have with structlog set up from the start."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import logging, sys
from broker_svc.logging import configure_logging, get_logger
configure_logging("warning", json=True, defer={defer})
log = get_logger("clockwork.probe")
log.info("below_the_level", n=1)
logging.getLogger("pika").info("below the level too")
print("structlog" in sys.modules)
log.warning("first_line", n=2, queue="q")
logging.getLogger("other.library").error("from the %s", "stdlib")
log.warning("third_line", n=3)
print("structlog" in sys.modules)
"""


def _run(defer: bool) -> tuple[list[str], list[dict[str, object]]]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(defer=defer)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    for line in lines:
        assert isinstance(line.pop("timestamp"), str)
    return out.stdout.split(), lines


def test_a_deferred_set_up_loads_structlog_only_for_the_first_line_at_its_level() -> None:
    printed, _ = _run(defer=True)
    assert printed == ["False", "True"]


def test_a_deferred_set_up_writes_the_same_lines_as_an_eager_one() -> None:
    (_, deferred), (_, eager) = _run(defer=True), _run(defer=False)
    assert deferred == eager
    assert [line["event"] for line in deferred] == ["first_line", "from the stdlib", "third_line"]
    assert deferred[0] == {
        "event": "first_line",
        "n": 2,
        "queue": "q",
        "level": "warning",
        "logger": "clockwork.probe",
    }
