"""One measurement in a process of its own: ``python -m bench.<system> SCENARIO --broker URL --queue Q``.

``bench.compare`` runs every measurement this way (with the system's own interpreter, so peers
run from their venv) and reads the single JSON line printed at the end:
``{"results": {"<system>": {"<figure>": value, ...}}}``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bench import scenarios
from bench.scenarios import Subject

Results = dict[str, dict[str, float]]


@dataclass(frozen=True, slots=True)
class Job:
    """What ``bench.compare`` asked for."""

    scenario: str
    broker_url: str
    queue: str
    count: int
    timeout_s: float
    wide: int


class NotApplicable(Exception):
    """The system has no such feature (the report shows "n/a" and says why)."""


# A scenario the generic code does not know (the control plane): it builds its own results.
Custom = Callable[[Job], Results]


def standard(job: Job, subject: Subject) -> dict[str, float]:
    """Run one of the scenarios every system shares.

    Raises:
        ValueError: an unknown scenario.
    """
    url, queue, count, timeout_s = job.broker_url, job.queue, job.count, job.timeout_s
    if job.scenario == "enqueue":
        return scenarios.enqueue(subject, queue, count)
    if job.scenario == "drain":
        return scenarios.drain(subject, url, queue, count, timeout_s)
    if job.scenario == "e2e":
        return scenarios.end_to_end(subject, url, queue, count, timeout_s)
    if job.scenario == "round_trip":
        return scenarios.round_trip(subject, url, queue, count)
    if job.scenario == "sleep":
        return scenarios.sleepers(subject, url, queue, count, timeout_s)
    if job.scenario == "memory":
        return scenarios.worker_memory(subject, url, queue, count, timeout_s)
    raise ValueError(f"unknown scenario {job.scenario!r}")


def parse_job(argv: Sequence[str] | None = None) -> Job:
    parser = argparse.ArgumentParser(description="Run one benchmark measurement; print its JSON line.")
    parser.add_argument("scenario")
    parser.add_argument("--broker", required=True, help="AMQP URL, vhost included")
    parser.add_argument("--queue", required=True, help="the queue to use (bench.compare deletes it after)")
    parser.add_argument("--count", type=int, required=True, help="tasks (or calls) in the scenario")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="upper bound of a drain")
    parser.add_argument("--wide", type=int, default=0, help="concurrency of the 'wide' worker (0: default)")
    args = parser.parse_args(argv)
    return Job(args.scenario, args.broker, args.queue, args.count, args.timeout_s, args.wide)


def main(system: str, make: Callable[[Job], Subject], custom: Mapping[str, Custom] | None = None) -> int:
    """Parse the job, run it, print ``{"results": ...}`` (or ``{"not_applicable": reason}``)."""
    job = parse_job()
    try:
        if custom and job.scenario in custom:
            results = custom[job.scenario](job)
        else:
            results = {system: standard(job, make(job))}
    except NotApplicable as exc:
        print(json.dumps({"not_applicable": str(exc)}), flush=True)
        return 0
    print(json.dumps({"results": results}), flush=True)
    return 0
