"""Write the figures of the last reliability run into RELIABILITY.md.

``python -m tests.reliability.summary`` reads the JSON lines the matrix tests appended (see
:func:`tests.reliability.journal.report`) and replaces the table between the markers in
RELIABILITY.md with the newest record of each test, rows in matrix order.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
START_MARKER = "<!-- reliability:last-run:start -->"
END_MARKER = "<!-- reliability:last-run:end -->"
_NOT_FIGURES = {"row", "test", "at"}


def _row_order(row: str) -> tuple[str, int, str]:
    match = re.fullmatch(r"([A-Z]+)(\d+)(.*)", row)
    return (match[1], int(match[2]), match[3]) if match else (row, 0, "")


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def newest(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The last record of each (row, test), sorted by row."""
    latest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for record in records:
        latest[(record["row"], record.get("test", ""))] = record
    return sorted(latest.values(), key=lambda r: (_row_order(r["row"]), r.get("test", "")))


def render(records: Sequence[Mapping[str, Any]]) -> str:
    """A markdown table: row, test, figures, when."""
    lines = ["| row | test | figures | run at (UTC) |", "|---|---|---|---|"]
    for record in records:
        figures = ", ".join(
            f"{key} {_format(value)}" for key, value in record.items() if key not in _NOT_FIGURES
        )
        test = str(record.get("test", "")).split("::", 1)[-1]
        lines.append(f"| {record['row']} | `{test}` | {figures} | {record.get('at', '')} |")
    return "\n".join(lines)


def rewrite(doc: Path, table: str) -> None:
    """Replace the text between the markers in ``doc`` with ``table``."""
    text = doc.read_text()
    start, end = text.index(START_MARKER) + len(START_MARKER), text.index(END_MARKER)
    doc.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / ".reliability" / "results.jsonl")
    parser.add_argument("--doc", type=Path, default=ROOT / "RELIABILITY.md")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    rewrite(args.doc, render(newest(records)))
    print(f"{len(newest(records))} tests written to {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
