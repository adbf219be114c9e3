"""Us beside Celery, Dramatiq and the raw AMQP libraries, in one run, alternating, with ratios.

Usage: ``make bench`` or ``python -m bench.compare [--rounds N] [--quick] [--only a,b] [--systems x,y]
[--baseline REV]``.
Each scenario runs every system in turn, round after round (A B C A B C …); every measurement is a
process of its own (``bench.driver``), peers from ``.bench-peers/`` (created on first use), bounded
by ``--timeout-s``, its queue deleted after it. Prints the table of medians, writes
``bench/results/latest.json`` (git-ignored) and, after a complete full-size run, the generated
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import compileall
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench import baseline, machine, queues, report
from bench.control import vhost
from bench.peers_venv import PEER_DISTRIBUTIONS, ensure_peers_venv, versions
from bench.stats import Spread
from bench.systems import (
    BASELINE,
    OURS,
    SCENARIO_NAMES,
    SCENARIOS,
    SYSTEM_NAMES,
    SYSTEMS,
    Sizes,
    System,
    Venv,
    baseline_system,
    interpreter,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "latest.json"
DOCUMENT = ROOT / "BENCHMARKS.md"
# Names a measurement may leave behind besides its queue: our dead-letter queue, Dramatiq's delay
# and dead-letter queues, an exchange named as the queue.
_SUFFIXES = ("", ".dead", ".DQ", ".XQ")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--broker", default=os.environ.get("CLOCKWORK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/")
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds per scenario (default 3)")
    parser.add_argument("--quick", action="store_true", help="about a tenth of the sizes (a smoke run)")
    parser.add_argument("--only", default=",".join(SCENARIO_NAMES), help="scenarios, comma-separated")
    parser.add_argument("--systems", default=",".join(SYSTEM_NAMES), help="systems, comma-separated")
    parser.add_argument("--size", action="append", default=[], metavar="NAME=COUNT", help="override a size")
    parser.add_argument(
        "--wide", action="append", default=[], metavar="SYSTEM=N", help="sleepers' concurrency"
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="upper bound of one measurement")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run our task scenarios from commit REV (a worktree in .bench-baseline/), before/after",
    )
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"results file (default {RESULTS})")
    parser.add_argument(
        "--doc",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite BENCHMARKS.md's generated section (default: only after a complete full-size run)",
    )
    args = parser.parse_args(argv)
    for option, given, known in (
        ("--only", args.only, SCENARIO_NAMES),
        ("--systems", args.systems, SYSTEM_NAMES),
    ):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            parser.error(f"{option}: unknown {sorted(unknown)}; known: {', '.join(known)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def _wide(pairs: list[str]) -> dict[str, int]:
    wide = {s.name: s.wide for s in SYSTEMS if s.wide}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in wide or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--wide {pair!r}: expected SYSTEM=N with SYSTEM one of {sorted(wide)}")
        wide[name] = int(value)
    return wide


def measure(
    system: System, python: str, scenario: str, url: str, count: int, wide: int, timeout_s: float
) -> dict[str, Any]:
    """Run one measurement in its own process group; kill the group if it outlives ``timeout_s``."""
    queue = f"bench_{scenario}_{system.name.replace('-', '_')}_{uuid.uuid4().hex[:8]}"
    cmd = [python, "-m", system.module, scenario, "--broker", url, "--queue", queue, "--count", str(count),
           "--timeout-s", str(max(30.0, timeout_s - 60)), "--wide", str(wide)]  # fmt: skip
    root = system.root or ROOT
    env = {**os.environ, "PYTHONPATH": str(root)}
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    outcome: dict[str, Any]
    try:
        out, err = proc.communicate(timeout=timeout_s)
        lines = out.decode(errors="replace").strip().splitlines()
        if proc.returncode == 0 and lines:
            outcome = json.loads(lines[-1])
            if system.name == BASELINE and "results" in outcome:  # it reports itself as us
                outcome["results"] = {BASELINE: outcome["results"][OURS]}
        else:
            outcome = {"error": f"exit {proc.returncode}: {err.decode(errors='replace')[-1500:]}"}
    except subprocess.TimeoutExpired:
        outcome = {"error": f"timed out after {timeout_s:.0f} s"}
    finally:
        _end_group(proc)
        queues.delete(url, [queue + s for s in _SUFFIXES], [queue])
    return {**outcome, "seconds": round(time.monotonic() - started, 1)}


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop what is left of a measurement's process group (ours: ``start_new_session``), normally
    nothing; after a timeout the driver and its workers get SIGTERM, then SIGKILL."""
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # reaped: a zombie leader would keep the group alive
                try:
                    os.killpg(proc.pid, 0)
                except ProcessLookupError:
                    return
            time.sleep(0.1)
    proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = (Sizes.quick() if args.quick else Sizes()).with_overrides(args.size)
    wide = _wide(args.wide)
    wanted_systems = [s for s in SYSTEMS if s.name in args.systems.split(",")]
    wanted_scenarios = [s for s in SCENARIOS if s.name in args.only.split(",")]
    base: dict[str, str] = {}
    if args.baseline:
        root, commit = baseline.checkout(args.baseline)
        wanted_systems.append(baseline_system(root))
        base = {"baseline": commit}
    peers_python = None
    if any(s.venv is Venv.PEERS for s in wanted_systems):
        peers_python = ensure_peers_venv()
    for root in {ROOT, *(s.root for s in wanted_systems if s.root is not None)}:
        compile_ours(root)
    began, started_at = time.monotonic(), dt.datetime.now(dt.UTC)
    runs: list[dict[str, Any]] = []
    with vhost(args.broker) as url:
        for scenario in wanted_scenarios:
            count = getattr(sizes, scenario.size_name)
            players = [s for s in wanted_systems if scenario.name in s.scenarios]
            for round_no in range(1, args.rounds + 1):
                for system in players:
                    outcome = measure(
                        system, interpreter(system, peers_python), scenario.name, url, count,
                        wide.get(system.name, 0), args.timeout_s,
                    )  # fmt: skip
                    runs.append(
                        {"scenario": scenario.name, "round": round_no, "system": system.name, **outcome}
                    )
                    _progress(runs[-1])
    return {
        "started": started_at.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - began, 1),
        "rounds": args.rounds,
        "quick": args.quick,
        "sizes": {s.name: getattr(sizes, s.size_name) for s in SCENARIOS},
        "wide": wide,
        "systems": [s.name for s in wanted_systems],
        **base,
        "machine": machine.describe(),
        "versions": {
            "project": {**machine.our_versions(), **_control_celery()},
            **({"peers": versions(peers_python, PEER_DISTRIBUTIONS)} if peers_python else {}),
        },
        "runs": runs,
    }


def _control_celery() -> dict[str, str]:
    # bench.control drives the project venv's Celery (the interop tests' one) for the ping figures.
    found = versions(sys.executable, ("celery",))
    return {"celery (control plane)": found["celery"]} if "celery" in found else {}


def _progress(run: dict[str, Any]) -> None:
    what = run.get("results") or run.get("not_applicable") or run.get("error")
    print(f"bench: {run['scenario']} round {run['round']} {run['system']} ({run['seconds']} s): {what}",
          file=sys.stderr, flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    systems = results["systems"]
    rows = report.summarize(results["runs"], systems)
    summary = [
        {"scenario": r.figure.scenario, "figure": r.figure.key, "system": s, **vars_of(sp)}
        for r in rows
        for s, sp in r.spreads.items()
    ]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**results, "summary": summary}, indent=2) + "\n")
    print(report.table(rows, systems))
    print(f"\nbench: {results['duration_s'] / 60:.1f} min; results in {args.json}")
    complete = (
        not args.quick
        and not args.baseline
        and args.only == ",".join(SCENARIO_NAMES)
        and args.systems == ",".join(SYSTEM_NAMES)
    )
    if args.doc if args.doc is not None else complete:
        report.update_document(DOCUMENT, report.section(results, rows, systems))
        print(f"bench: updated the generated section of {DOCUMENT.name}")
    failed = [f"{r['scenario']}/{r['system']}/round {r['round']}" for r in results["runs"] if "error" in r]
    if failed:
        print(f"bench: {len(failed)} measurement(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def compile_ours(root: Path) -> None:
    """Write our packages' bytecode, as ``pip install`` does for the peers' (their venv has it).

    Without it (an editable install under ``PYTHONDONTWRITEBYTECODE``), every worker process
    compiles our modules as it imports them: 2 MiB more PSS and a slower start than installed.
    """
    for package in ("broker_svc", "control", "worker", "bench"):
        compileall.compile_dir(root / package, quiet=1)


def vars_of(spread: Spread) -> dict[str, float]:
    return {"median": spread.median, "min": spread.low, "max": spread.high, "rounds": spread.rounds}


if __name__ == "__main__":
    sys.exit(main())
