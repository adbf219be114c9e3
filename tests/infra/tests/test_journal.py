"""The chaos checker counts what it should: lost, duplicated, unexpected, unmarked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.reliability.journal import JOURNAL_ENV, REPORT_ENV, Journal, check, record_execution, report


def _run(monkeypatch: pytest.MonkeyPatch, journal: Journal, task_id: str, **info: object) -> None:
    monkeypatch.setenv(JOURNAL_ENV, str(journal.directory))
    record_execution(task_id, info)


def test_check_counts_lost_duplicates_unexpected_and_unmarked(tmp_path: Path, monkeypatch):
    journal = Journal(tmp_path / "j")
    for task_id in ("a", "b", "c"):
        journal.published(task_id, confirmed=True)
    journal.published("d", confirmed=False)  # never confirmed: not lost if it never ran
    _run(monkeypatch, journal, "a")
    _run(monkeypatch, journal, "a", redelivered=True)  # a marked duplicate
    _run(monkeypatch, journal, "b")
    _run(monkeypatch, journal, "b")  # an unmarked duplicate
    _run(monkeypatch, journal, "zz")  # never published

    verdict = check(journal)

    assert (verdict.published, verdict.confirmed, verdict.executed) == (4, 3, 3)
    assert verdict.lost == 1  # "c"
    assert verdict.duplicated == 2
    assert verdict.unmarked_duplicates == 1
    assert verdict.unexpected == 1
    assert verdict.max_runs == 2


def test_a_cut_last_line_is_not_a_record(tmp_path: Path, monkeypatch):
    journal = Journal(tmp_path / "j")
    _run(monkeypatch, journal, "a", delivery_count=2)
    with (journal.directory / "executed.jsonl").open("a") as out:
        out.write('{"id": "b", "pi')  # a worker killed mid-write

    [execution] = journal.executions()
    assert execution.task_id == "a" and execution.marked


def test_report_prints_and_appends_one_json_line(tmp_path: Path, monkeypatch, capsys):
    out = tmp_path / "report.jsonl"
    monkeypatch.setenv(REPORT_ENV, str(out))
    journal = Journal(tmp_path / "j")
    journal.published("a", confirmed=True)

    report("R0", check(journal), recovery_s=1.5)

    printed = capsys.readouterr().out.strip()
    assert printed.startswith("RELIABILITY ")
    record = json.loads(out.read_text())
    assert record == json.loads(printed.removeprefix("RELIABILITY "))
    assert (record["row"], record["lost"], record["recovery_s"]) == ("R0", 1, 1.5)
