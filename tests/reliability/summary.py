"""Write the figures of the last reliability run into RELIABILITY.md, one table per worker design.

``python -m tests.reliability.summary`` reads the JSON lines the matrix tests appended (see
:func:`tests.reliability.journal.report`) and, for each design, replaces the rows of the table
between that design's markers in RELIABILITY.md with the newest record of each test, rows in
matrix order. A test with no record in the file keeps the row it had, so a run of one file (or
of one design) leaves the others' figures in place.

Designs (``design`` in a record, from ``CLOCKWORK_TEST_WORKER_ARGS``): ``children-consume``, each
pool child consuming with one thread, and ``threads``, the same with ``--threads N`` (N > 1).
Records of the retired design, where the worker's main process consumed for its children
(``worker-consumes``, and untagged records, which predate the tag), have no table and are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Each design's table, between its markers.
MARKERS = {
    "children-consume": (
        "<!-- reliability:last-run:children-consume:start -->",
        "<!-- reliability:last-run:children-consume:end -->",
    ),
    "threads": (  # consuming children under CLOCKWORK_TEST_WORKER_ARGS="--threads N"
        "<!-- reliability:last-run:threads:start -->",
        "<!-- reliability:last-run:threads:end -->",
    ),
}
_NOT_FIGURES = {"row", "test", "at", "design"}
_HEADER = ["| row | test | figures | run at (UTC) |", "|---|---|---|---|"]
_LINE = re.compile(r"\| (?P<row>[^|]+?) \| `(?P<test>[^`]*)` \|")


def _row_order(row: str) -> tuple[str, int, str]:
    match = re.fullmatch(r"([A-Z]+)(\d+)(.*)", row)
    return (match[1], int(match[2]), match[3]) if match else (row, 0, "")


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def design_of(record: Mapping[str, Any]) -> str | None:
    """The worker design a record was measured with; None for an untagged one (the retired design's)."""
    design = record.get("design")
    return str(design) if design else None


def newest(records: Iterable[Mapping[str, Any]], *, design: str) -> list[Mapping[str, Any]]:
    """The last record of each (row, test) measured with ``design``, sorted by row."""
    latest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for record in records:
        if design_of(record) == design:
            latest[(record["row"], record.get("test", ""))] = record
    return sorted(latest.values(), key=lambda r: (_row_order(r["row"]), r.get("test", "")))


def _short(test: str) -> str:
    return test.split("::", 1)[-1]


def render_line(record: Mapping[str, Any]) -> str:
    """One table line: row, test, figures, when."""
    figures = ", ".join(f"{key} {_format(value)}" for key, value in record.items() if key not in _NOT_FIGURES)
    return (
        f"| {record['row']} | `{_short(str(record.get('test', '')))}` | {figures} | {record.get('at', '')} |"
    )


def render(records: Sequence[Mapping[str, Any]], *, kept: Sequence[str] = ()) -> str:
    """A markdown table of ``records``, plus the ``kept`` lines of tests they have no record of."""
    lines = {(str(r["row"]), _short(str(r.get("test", "")))): render_line(r) for r in records}
    for line in kept:
        match = _LINE.match(line)
        if match and (match["row"], match["test"]) not in lines:
            lines[(match["row"], match["test"])] = line
    ordered = sorted(lines.items(), key=lambda item: (_row_order(item[0][0]), item[0][1]))
    return "\n".join([*_HEADER, *(line for _, line in ordered)])


def table_lines(text: str, start_marker: str, end_marker: str) -> list[str]:
    """The table lines now between the markers (header and separator left out)."""
    start, end = text.index(start_marker) + len(start_marker), text.index(end_marker)
    return [line for line in text[start:end].splitlines() if _LINE.match(line)]


def rewrite(doc: Path, table: str, *, markers: tuple[str, str]) -> None:
    """Replace the text between ``markers`` in ``doc`` with ``table``."""
    text = doc.read_text()
    start, end = text.index(markers[0]) + len(markers[0]), text.index(markers[1])
    doc.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / ".reliability" / "results.jsonl")
    parser.add_argument("--doc", type=Path, default=ROOT / "RELIABILITY.md")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    # The retired design's records stay in the file (it is append-only) but have no table now.
    skipped = sum(1 for record in records if design_of(record) not in MARKERS)
    if skipped:
        print(f"{skipped} records of a retired design (worker-consumes, or untagged) skipped")
    for design, markers in MARKERS.items():
        text = args.doc.read_text()
        latest = newest(records, design=design)
        if markers[0] not in text:
            if latest:
                print(f"{len(latest)} {design} tests not written: {args.doc} has no {markers[0]}")
            continue
        rewrite(args.doc, render(latest, kept=table_lines(text, *markers)), markers=markers)
        print(f"{len(latest)} {design} tests written to {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
