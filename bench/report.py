"""The side-by-side table: medians over the rounds, spreads, ratios ours / peer; the BENCHMARKS.md section."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.stats import Spread, ratio
from bench.systems import LABELS, OUR_SYSTEMS, OURS, THREADS

START_MARKER = "<!-- bench:compare:start -->"
END_MARKER = "<!-- bench:compare:end -->"


@dataclass(frozen=True, slots=True)
class Figure:
    scenario: str
    key: str
    label: str
    higher_is_better: bool


FIGURES = (
    Figure("enqueue", "confirmed_per_s", "enqueue: tasks/s until all confirmed", True),
    Figure("enqueue", "calls_per_s", "enqueue: send calls/s (until the last call returned)", True),
    Figure("drain", "tasks_per_s", "drain: tasks/s", True),
    Figure("e2e", "tasks_per_s", "end to end: tasks/s", True),
    Figure("round_trip", "p50_ms", "round trip p50, ms", False),
    Figure("round_trip", "p99_ms", "round trip p99, ms", False),
    Figure("sleep", "tasks_per_s", "10 ms sleepers: tasks/s", True),
    Figure("memory", "idle_pss_mib", "memory idle, PSS MiB", False),
    Figure("memory", "idle_rss_mib", "memory idle, RSS MiB (summed)", False),
    Figure("memory", "load_pss_mib", "memory draining, peak PSS MiB", False),
    Figure("memory", "load_rss_mib", "memory draining, peak RSS MiB (summed)", False),
    Figure("control", "ping_1w_ms", "inspect ping, 1 worker, in process, ms", False),
    Figure("control", "ping_3w_ms", "inspect ping, 3 workers, in process, ms", False),
    Figure("control", "ping_cmd_1w_ms", "ping as a command (`ctl` / `celery`), 1 worker, ms", False),
    Figure("control", "ping_cmd_3w_ms", "ping as a command, 3 workers, ms", False),
    Figure("control", "revoke_call_ms", "`revoke(reply=True)` call, ms", False),
    Figure("control", "revoke_to_skip_ms", "revoke → REVOKED result of a task sent after it, ms", False),
)


@dataclass(frozen=True, slots=True)
class Row:
    figure: Figure
    spreads: dict[str, Spread]  # by system; systems without a value are left out
    failures: dict[str, str]  # by system: "failed" or "n/a"


def summarize(runs: Iterable[Mapping[str, Any]], systems: Sequence[str]) -> list[Row]:
    """Collect each figure's values per system over the rounds."""
    values: dict[tuple[str, str, str], list[float]] = {}
    failed: dict[tuple[str, str], str] = {}
    for run in runs:
        for system, figures in (run.get("results") or {}).items():
            for key, value in figures.items():
                values.setdefault((run["scenario"], key, system), []).append(float(value))
        if "error" in run:
            failed.setdefault((run["scenario"], run["system"]), "failed")
        if "not_applicable" in run:
            failed.setdefault((run["scenario"], run["system"]), "n/a")
    rows = []
    for figure in FIGURES:
        spreads = {
            s: Spread.of(values[(figure.scenario, figure.key, s)])
            for s in systems
            if (figure.scenario, figure.key, s) in values
        }
        failures = {s: failed[(figure.scenario, s)] for s in systems if (figure.scenario, s) in failed}
        if spreads or failures:
            rows.append(Row(figure, spreads, failures))
    return rows


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def _cell(row: Row, system: str) -> str:
    spread = row.spreads.get(system)
    if spread is None:
        return row.failures.get(system, "—")
    if spread.rounds == 1:
        return _number(spread.median)
    return f"{_number(spread.median)} ({_number(spread.low)}–{_number(spread.high)})"


def _ratio(row: Row, peer: str, ours_name: str = OURS) -> str:
    ours, theirs = row.spreads.get(ours_name), row.spreads.get(peer)
    if ours is None or theirs is None:
        return "—"
    value = ratio(ours.median, theirs.median)
    if value is None:
        return "—"
    return f"{value:.2f}×" if value >= 0.1 else f"{value:.2g}×"


def table(rows: Sequence[Row], systems: Sequence[str]) -> str:
    """A Markdown table: median (min–max) per system, then ours / peer of the medians.

    With both of our shapes in the run, each gets its ratios (``threads / peer`` for ``--threads 8``),
    and the default's include ``ours / threads``.
    """
    peers = [s for s in systems if s != OURS]
    extra = [p for p in peers if p not in OUR_SYSTEMS] if THREADS in systems else []
    header = [
        "figure", "better", *(LABELS[s] for s in systems), *(f"ours / {LABELS[p]}" for p in peers),
        *(f"threads / {LABELS[p]}" for p in extra),
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        better = "higher" if row.figure.higher_is_better else "lower"
        cells = [
            row.figure.label,
            better,
            *(_cell(row, s) for s in systems),
            *(_ratio(row, p) for p in peers),
            *(_ratio(row, p, THREADS) for p in extra),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def replace_section(document: str, section: str, *, title_line: str = "# Benchmarks") -> str:
    """Put ``section`` between the markers, adding them after the title if they are missing.

    Nothing outside the markers changes.
    """
    block = f"{START_MARKER}\n{section.strip()}\n{END_MARKER}"
    start, end = document.find(START_MARKER), document.find(END_MARKER)
    if start != -1 and end > start:
        return document[:start] + block + document[end + len(END_MARKER) :]
    lines = document.splitlines(keepends=True)
    at = next((i + 1 for i, line in enumerate(lines) if line.strip() == title_line), 0)
    return "".join(lines[:at]) + "\n" + block + "\n" + "".join(lines[at:])


def update_document(path: Path, section: str) -> None:
    path.write_text(replace_section(path.read_text(), section))


def settings_text(sizes: Mapping[str, int], wide: Mapping[str, int]) -> str:
    """The exact settings of every system, for the section under the table."""
    return f"""\
- **Everyone**: the local RabbitMQ, a vhost of the run's own, a fresh queue per measurement
  (deleted after it); workers log at INFO to a temporary file (Clockwork and Celery write lines
  per task there, Dramatiq does not); persistent messages; ack after the task ran. Figures are read from the
  broker's side the same way for all (passive `queue.declare` every 10 ms): *drain* is the
  deliveries between the first one seen with every consumer of the worker on the queue (2 for
  Dramatiq, 1 per child for our consuming children, threads or not) and the moment no message is left
  ready, over that time (in
  steady state deliveries and completions match; the prefetch at either end is at most a few
  hundred of {sizes["drain"]:,}); *end to end* is {sizes["e2e"]:,} tasks over the time from the
  first timed send (worker already consuming) until none is left ready; *enqueue* is
  {sizes["enqueue"]:,} sends after one warm-up send, until the broker confirmed the last.
- **Clockwork**: `python -m worker -c 2` (each pool child consumes on a connection of its own
  with the default prefetch budget, 10 ms of work: no-op tasks take it from 1 to 64 unacked per
  child within a few tasks; the main process on asyncio's own loop;
  `--without-mingle --statedb none`; our packages' bytecode written first, as `pip install` writes
  the peers');
  client `App.send_task` with its default pipelined confirms (a call returns once handed to the
  I/O thread; *calls/s* counts those, *confirmed* waits for all); results over the client's reply
  queue. Sleepers: `-c 2 --threads {wide.get("clockwork", 0) // 2} --prefetch-multiplier 2`
  ({wide.get("clockwork", 0)} threads; each child's threads share one connection with prefetch
  twice its threads, as Dramatiq's). *Clockwork, --threads 8*: the same worker in Dramatiq's drain
  shape, `-c 2 --threads 8 --prefetch-multiplier 2` (16 at once, 32 unacked, as Dramatiq's), drain
  and end to end only.
- **Celery**: `celery worker -P prefork -c 2 --without-mingle --without-gossip`, `task_acks_late`,
  default prefetch multiplier 4 (8 unacked), rpc:// results, JSON,
  `broker_transport_options={{"confirm_publish": True}}` (each `apply_async` waits for its confirm).
  Queues are declared by Celery itself. Sleepers: `-P threads -c {wide.get("celery", 0)}`
  (gevent is not installed).
- **Dramatiq**: `dramatiq -p 2 -t 8` (prefetch 2 × threads per process), `RabbitmqBroker(
  confirm_delivery=True)` (each `send()` waits for its confirm), default middleware. Its Results
  middleware has no RabbitMQ backend (Redis, Memcached only), so the round trip uses an actor that
  publishes its result to the caller's exclusive reply queue, as Celery's rpc:// does. Sleepers:
  `-p 2 -t {wide.get("dramatiq", 0) // 2}` ({wide.get("dramatiq", 0)} threads).
- **pika / aio-pika (raw)**: the ceiling. Our no-op message's bytes and headers, publisher confirms
  pipelined up to 1,000 unconfirmed (pika `SelectConnection`; aio-pika awaiting up to 1,000
  publishes at once); the "worker" is one process consuming with prefetch 100 and one ack per
  message, nothing else (aio-pika, on uvloop when it is installed). In the round trip it also answers each
  call as our worker does: our no-op result's bytes to the call's `reply_to` with its
  `correlation_id` (non-persistent, mandatory, on a confirm-mode channel, confirm awaited before
  the ack). The client declares a reply queue shaped as ours (durable, `x-expires`), consumes it
  without acks and publishes our call message (persistent, `reply_to`, a fresh `correlation_id`)
  on one connection; aio-pika with confirms pipelined as ours (the call waits only for its
  reply), pika with a `BlockingConnection` *without* confirms, since its confirm mode makes each
  publish wait for its confirm.
- **Fills** (drain, sleepers, memory) are untimed: each system's own message format published
  without confirms (ours through `App.send_many`).
- **Round trip**: 50 warm-up calls, then {sizes["round_trip"]:,} sequential calls of a no-op task with its
  result, worker started as for the drain.
- **Sleepers**: {sizes["sleep"]:,} queued tasks that sleep 10 ms, measured as the drain.
- **Memory**: `Pss` and `Rss` of `/proc/<pid>/smaps_rollup` summed over the worker's process tree
  (main, pool children, forkserver), 2 s after it started consuming, then the peak (sampled every
  0.2 s) while it drains {sizes["memory"]:,} no-op tasks sent to it. PSS shares pages between the
  processes; summed RSS counts them in each.
- **Control plane**: `bench.control`'s functions with Celery from the project venv (solo
  workers, `inspect(timeout=1)`, which always waits out its timeout); medians of
  {sizes["control"]} in-process calls, 5 commands (interpreter start-up included).
  Revoke-to-skip is ours only; Dramatiq has no control plane."""


def section(results: Mapping[str, Any], rows: Sequence[Row], systems: Sequence[str]) -> str:
    """The generated part of BENCHMARKS.md."""
    machine = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"]["project"].items())
    peer_versions = ", ".join(f"{k} {v}" for k, v in results["versions"].get("peers", {}).items())
    return f"""\
## Side by side (`make bench`, generated {results["finished"][:10]})

Generated by `python -m bench.compare`; do not edit between the markers. Rounds: {results["rounds"]},
each system in turn within a round (A B C … A B C …). Cells are the median over the rounds with
(min–max); ratios are ours / peer of the medians, and "better" says which way wins. The run took
{results["duration_s"] / 60:.1f} min.

{table(rows, systems)}

Machine: {machine["cpus"]} CPUs ({machine["cpu_model"]}), {machine["ram"]} RAM, kernel {machine["kernel"]},
Python {machine["python"]}, RabbitMQ {machine["rabbitmq"]} on loopback, shared with every process.
Project venv: {versions}. Peers venv (`.bench-peers/`, from PyPI): {peer_versions or "not used"}.

{settings_text(results["sizes"], results["wide"])}
"""
