"""The systems and scenarios of the side-by-side run: who runs what, with which interpreter and sizes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from enum import StrEnum
from pathlib import Path


class Venv(StrEnum):
    PROJECT = "project"  # .venv: us and the raw-library ceiling
    PEERS = "peers"  # .bench-peers: Celery and Dramatiq from PyPI


@dataclass(frozen=True, slots=True)
class System:
    name: str
    label: str
    module: str  # run as ``python -m <module> SCENARIO ...`` (bench.driver)
    venv: Venv
    scenarios: frozenset[str]
    wide: int  # concurrency of the worker of the "sleep" scenario (0: none)
    root: Path | None = None  # the checkout it runs from, when not this one (the baseline)


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    title: str
    size_name: str  # the field of Sizes that gives its count


SCENARIOS = (
    Scenario("enqueue", "enqueue no-op tasks with confirms, no worker", "enqueue"),
    Scenario("drain", "drain queued no-op tasks, 2 worker processes, ack after run", "drain"),
    Scenario("e2e", "end to end: producer and a started worker together", "e2e"),
    Scenario(
        "round_trip", "round trip: one task and its result, sequential calls, warm worker", "round_trip"
    ),
    Scenario("sleep", "drain queued tasks that sleep 10 ms, high concurrency", "sleep"),
    Scenario("memory", "worker memory (whole process tree), idle and draining", "memory"),
    Scenario("control", "control plane: inspect ping, revoke-to-skip", "control"),
)
SCENARIO_NAMES = tuple(s.name for s in SCENARIOS)

_TASKS = frozenset({"enqueue", "drain", "e2e", "round_trip", "sleep", "memory"})
_THREADS = frozenset({"drain", "e2e"})  # where the shape matters; its sleepers are the default's
_CEILING = frozenset({"enqueue", "drain", "e2e", "round_trip"})

OURS = "clockwork"
THREADS = "clockwork-threads"  # the same worker in Dramatiq's drain shape: -c 2 --threads 8, 32 unacked
OUR_SYSTEMS = (OURS, THREADS)
SYSTEMS = (
    # Our control scenario also measures Celery's control plane (bench.control runs both).
    System(OURS, "Clockwork", "bench.ours", Venv.PROJECT, _TASKS | {"control"}, 50),
    System(THREADS, "Clockwork, --threads 8", "bench.ours_threads", Venv.PROJECT, _THREADS, 0),
    System("celery", "Celery", "bench.peers.celery_subject", Venv.PEERS, _TASKS, 50),
    System("dramatiq", "Dramatiq", "bench.peers.dramatiq_subject", Venv.PEERS, _TASKS, 50),
    System("pika", "pika (raw)", "bench.ceiling_pika", Venv.PROJECT, _CEILING, 0),
    System("aio-pika", "aio-pika (raw)", "bench.ceiling_aio_pika", Venv.PROJECT, _CEILING, 0),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)

# Our code at an earlier commit (``--baseline REV``): the task scenarios, for before/after a change.
BASELINE = "baseline"
LABELS = {**{s.name: s.label for s in SYSTEMS}, BASELINE: "Clockwork baseline"}


def baseline_system(root: Path) -> System:
    """Our subject run from the checkout at ``root``."""
    return System(BASELINE, LABELS[BASELINE], "bench.ours", Venv.PROJECT, _TASKS, 16, root=root)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How many tasks (or calls) each scenario uses."""

    enqueue: int = 20_000
    drain: int = 20_000
    e2e: int = 5_000  # the peers' producers wait for each confirm: ~10 s each already
    round_trip: int = 500
    sleep: int = 5_000  # 0.1 s of work at 50 at once, per 500: a start-up would weigh
    memory: int = 5_000
    control: int = 5  # in-process pings per worker count, and revokes (Celery's take 1 s each)

    @classmethod
    def quick(cls) -> Sizes:
        """About a tenth: a smoke run of every scenario in about two minutes."""
        return cls(enqueue=2_000, drain=2_000, e2e=500, round_trip=100, sleep=500, memory=1_000, control=3)

    def with_overrides(self, pairs: list[str]) -> Sizes:
        """Apply ``name=count`` overrides.

        Raises:
            ValueError: an unknown name or a count that is not a positive integer.
        """
        known = {f.name for f in fields(self)}
        changes: dict[str, int] = {}
        for pair in pairs:
            name, _, value = pair.partition("=")
            if name not in known or not value.isdigit() or int(value) < 1:
                raise ValueError(f"--size {pair!r}: expected NAME=COUNT with NAME one of {sorted(known)}")
            changes[name] = int(value)
        return replace(self, **changes)


def interpreter(system: System, peers_python: Path | None) -> str:
    """The Python that runs ``system``'s measurements.

    Raises:
        RuntimeError: a peer system without the peers' venv.
    """
    if system.venv is Venv.PROJECT:
        return sys.executable
    if peers_python is None:
        raise RuntimeError(f"{system.name} runs from the peers' venv, which was not set up")
    return str(peers_python)
