"""``python -m worker``: run a worker in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn

from broker_svc.errors import BrokerUnavailable, ConfigurationError
from broker_svc.logging import configure_logging
from broker_svc.settings import split_names
from broker_svc.version import add_version_option
from worker.beat.cli import add_beat_options, beat_for
from worker.config import (
    DEFAULT_CONSUMER_TIMEOUT_S,
    DEFAULT_HOSTNAME,
    WorkerConfig,
    default_state_path,
    expand_hostname,
    parse_autoscale,
)
from worker.loader import AppImportFailed, AppNotFound, BadAppSpec, NotAnApp, load_app, use_current_directory
from worker.process_files import redirect_output, write_pidfile
from worker.rules.prefetch_budget import DEFAULT_BUDGET_S
from worker.service import WorkerService


class _Parser(argparse.ArgumentParser):
    # A usage error is the error and a pointer to --help, not the 17 lines of every option.
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the options.\n")


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (Celery's option names); docs/guide.md's options table lists each."""
    parser = _Parser(prog="clockwork-worker", description="Run a Clockwork worker.")
    add_version_option(parser)
    parser.add_argument("-A", "--app", required=True, help="the app: package.module:app")
    parser.add_argument(
        "-c", "--concurrency", type=int, default=None,
        help="child processes (default: the app's worker_concurrency, else the number of CPUs)",
    )  # fmt: skip
    parser.add_argument("-n", "--hostname", default=DEFAULT_HOSTNAME, help="node name (%%h = host)")
    parser.add_argument(
        "-Q", "--queues", default=None, help="comma-separated queues (default: the app's default queue)"
    )
    parser.add_argument(
        "-b", "--broker", default=None, help="AMQP URL (default: the app's, else $CLOCKWORK_BROKER_URL)"
    )
    parser.add_argument("-l", "--loglevel", default="info", help="debug, info, warning, error")
    parser.add_argument(
        "--prefetch-multiplier",
        type=int,
        default=None,
        help="a fixed prefetch: unacked deliveries per child and queue, running ones included (1: take only "
        "what can start); default: the prefetch budget",
    )
    parser.add_argument(
        "--prefetch-budget",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="each child holds about this much work, by its recent task times: short tasks get a deep "
        f"prefetch, long ones 1 (default {DEFAULT_BUDGET_S * 1000:g}ms; '10ms' or 0.01; 0: a fixed "
        "prefetch of 1); a --prefetch-multiplier fixes it instead",
    )
    parser.add_argument(
        "--autoscale",
        type=_autoscale,
        default=None,
        metavar="MAX,MIN",
        help="grow the pool up to MAX children while tasks wait, shrink to MIN (default 0; at least "
        "one child stays) when idle; overrides -c",
    )
    parser.add_argument(
        "--autoscale-keepalive",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long a child the pool did not need stays before autoscale retires it (default 30)",
    )
    parser.add_argument(
        "--max-tasks-per-child",
        type=int,
        default=None,
        metavar="N",
        help="replace a pool child after N tasks (default: the app's worker_max_tasks_per_child, else never)",
    )
    parser.add_argument(
        "--max-memory-per-child",
        type=int,
        default=None,
        metavar="KIB",
        help="replace a pool child whose resident memory passed KIB kilobytes, after its task",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics (celery-exporter's names) on this port at /metrics (default: off)",
    )
    parser.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        metavar="ADDR",
        help="address for --metrics-port (default all)",
    )
    parser.add_argument("--logfile", "-f", type=Path, default=None, help="append all output to this file")
    parser.add_argument("--pidfile", type=Path, default=None, help="write the worker's pid here")
    parser.add_argument(
        "-O",
        dest="optimization",
        choices=("fair", "default"),
        default="fair",
        help="accepted for Celery's command lines: dispatch is always fair (a task goes to an idle child)",
    )
    parser.add_argument(
        "-P",
        "--pool",
        default="prefork",
        help="prefork only (the default); for Celery's threads pool use --threads",
    )
    parser.add_argument(
        "-B", "--beat", action="store_true",
        help="also run the periodic scheduler (any number of workers may: one leads and fires)",
    )  # fmt: skip
    add_beat_options(parser)
    parser.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish tasks")
    parser.add_argument("--time-limit", type=float, default=None, help="default hard time limit (s)")
    parser.add_argument("--soft-time-limit", type=float, default=None, help="default soft time limit (s)")
    parser.add_argument(
        "--statedb",
        default=None,
        help="state file of revoked ids (default $CLOCKWORK_STATE_DIR/<node>.state); 'none' disables it",
    )
    parser.add_argument("-E", "--task-events", action="store_true", help="send task events from the start")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, help="worker-heartbeat interval (s)")
    parser.add_argument("--without-mingle", action="store_true", help="skip syncing with peers at start-up")
    parser.add_argument(
        "--quorum-queues",
        default=None,
        metavar="A,B",
        help="task queues to declare as quorum queues (default $CLOCKWORK_QUORUM_QUEUES; clients must agree)",
    )
    parser.add_argument(
        "--ordered-queues",
        default=None,
        metavar="A,B",
        help="task queues to declare and consume as ordered queues: one consumer of all workers runs "
        "their tasks, one at a time, in order (default $CLOCKWORK_ORDERED_QUEUES or the app's "
        "task_ordered_queues; clients must agree; docs/guide.md, 'Ordered queues')",
    )
    parser.add_argument(
        "--delivery-limit",
        type=int,
        default=None,
        metavar="N",
        help="dead-letter a message after N deliveries that did not finish (its worker or child died); "
        "default $CLOCKWORK_DELIVERY_LIMIT or 3",
    )
    parser.add_argument(
        "--dedupe-window",
        type=float,
        default=None,
        metavar="SECONDS",
        help="skip a task id this worker finished within SECONDS (opt-in, per worker; default off)",
    )
    parser.add_argument(
        "--broker-heartbeat",
        type=int,
        default=None,
        metavar="SECONDS",
        help="AMQP heartbeat to ask the broker for (default: the settings' heartbeat_s, 30; 0: off)",
    )
    parser.add_argument(
        "--consumer-timeout",
        type=float,
        default=DEFAULT_CONSUMER_TIMEOUT_S,
        metavar="SECONDS",
        help="the broker's consumer_timeout (default 1800, RabbitMQ's); warns at start-up about task "
        "time limits it would cut short; 0 skips the check",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="N consumers per child, each in a thread (for tasks that wait "
        "on I/O; soft time limits only between bytecodes, a hard limit or terminate ends the child)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the worker's command line, checking what argparse cannot."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.pool not in ("prefork", "processes"):
        instead = _POOL_HINTS.get(args.pool, "Celery's pools are prefork, solo, threads, gevent and eventlet")
        parser.error(f"-P {args.pool}: Clockwork runs tasks in a process pool (prefork); {instead}")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error(f"-c/--concurrency must be at least 1, got {args.concurrency}")
    if args.queues and not [q for q in args.queues.split(",") if q.strip()]:
        parser.error(f"-Q/--queues names no queue: {args.queues!r}")
    for option in ("max_tasks_per_child", "max_memory_per_child"):
        value = getattr(args, option)
        if value is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    return args


# What to use instead of Celery's other pools. Not mapped silently: threads in processes differ
# from Celery's one-process thread pool (time limits, terminate: docs/guide.md, --threads).
_POOL_HINTS: Final = {
    "threads": "for tasks that wait on I/O use --threads N (N task threads in each child; Celery's "
    "'-P threads -c 8' is about '-c 1 --threads 8')",
    "solo": "for one task at a time in one child use -c 1",
    "gevent": "for tasks that wait on I/O use --threads N (task threads in each child), or async def tasks",
    "eventlet": "for tasks that wait on I/O use --threads N (task threads in each child), or async def tasks",
}


def _seconds(value: str) -> float:
    text = value.strip().lower()
    scale = 0.001 if text.endswith("ms") else 1.0
    try:
        seconds = float(text.removesuffix("ms").removesuffix("s")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, as 0.01 or 10ms; got {value!r}") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or a positive time, got {value!r}")
    return seconds


def _autoscale(value: str) -> tuple[int, int]:
    try:
        return parse_autoscale(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2: a usage error, 1: another failure, 130: Ctrl-C)."""
    args = parse_args(argv)
    try:
        return _start(args)
    except KeyboardInterrupt:  # before the worker's own handlers exist (importing the app, say)
        _say("interrupted")
        return 130


def _start(args: argparse.Namespace) -> int:
    try:
        configure_logging(args.loglevel)
        if args.logfile is not None:
            redirect_output(args.logfile)
        if args.pidfile is not None:
            write_pidfile(args.pidfile)
    except (ConfigurationError, ValueError) as exc:
        return _say(str(exc), status=2)
    os.environ["CLOCKWORK_LOGLEVEL"] = args.loglevel  # pool children log at the same level
    use_current_directory()
    # One rule for every entry point: this command line, then the app's own (settings=, or app.conf
    # over CLOCKWORK_* variables, as App builds them), then the defaults.
    try:
        app = load_app(args.app)
    except (BadAppSpec, AppNotFound, AppImportFailed, NotAnApp) as exc:
        # One line says it all; -l debug adds the traceback. An error raised *inside* the user's
        # module is not caught here: its traceback points at their line.
        if args.loglevel.lower() == "debug":
            traceback.print_exc()
        return _say(str(exc), status=2)
    settings = app.settings
    if args.broker:
        settings = settings.with_options(broker_url=args.broker)
    if args.quorum_queues is not None:
        settings = settings.with_options(quorum_queues=split_names(args.quorum_queues))
    if args.ordered_queues is not None:
        settings = settings.with_options(ordered_queues=split_names(args.ordered_queues))
    if args.delivery_limit is not None:
        settings = settings.with_options(delivery_limit=args.delivery_limit)
    conf = app.conf
    if args.prefetch_multiplier is not None and args.prefetch_budget is not None:
        return _say("give --prefetch-multiplier (a fixed prefetch) or --prefetch-budget, not both", status=2)
    fixed = args.prefetch_multiplier or conf.get("worker_prefetch_multiplier")
    budget = args.prefetch_budget if args.prefetch_budget is not None else conf.get("worker_prefetch_budget")
    concurrency = args.concurrency or conf.get("worker_concurrency") or os.cpu_count() or 1
    queues = tuple(q.strip() for q in (args.queues or settings.default_queue).split(",") if q.strip())
    hostname = expand_hostname(args.hostname)
    if args.statedb is None:
        state_path: Path | None = default_state_path(hostname)
    else:
        state_path = None if args.statedb.lower() == "none" else Path(args.statedb)
    config = WorkerConfig(
        app_spec=args.app,
        settings=settings,
        hostname=hostname,
        queues=queues,
        # As Celery, an autoscaled pool starts at its minimum (here at least one child).
        concurrency=max(args.autoscale[1], 1) if args.autoscale else concurrency,
        prefetch_multiplier=fixed or 1,
        # A multiplier given (here or as Celery's worker_prefetch_multiplier) fixes the prefetch.
        prefetch_budget_s=None if fixed else (DEFAULT_BUDGET_S if budget is None else budget) or None,
        shutdown_timeout_s=args.shutdown_timeout,
        time_limit_s=args.time_limit if args.time_limit is not None else conf.get("task_time_limit"),
        soft_time_limit_s=(
            args.soft_time_limit if args.soft_time_limit is not None else conf.get("task_soft_time_limit")
        ),
        state_path=state_path,
        task_events=args.task_events,
        event_heartbeat_s=args.heartbeat_interval,
        mingle=not args.without_mingle,
        autoscale=args.autoscale,
        autoscale_keepalive_s=args.autoscale_keepalive,
        dedupe_window_s=args.dedupe_window,
        broker_heartbeat_s=args.broker_heartbeat,
        consumer_timeout_s=args.consumer_timeout or None,
        max_tasks_per_child=args.max_tasks_per_child or conf.get("worker_max_tasks_per_child"),
        max_memory_per_child_kib=args.max_memory_per_child or conf.get("worker_max_memory_per_child"),
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        threads=args.threads,
    )
    beat = None
    if args.beat:
        if args.broker:
            app.conf["broker_url"] = args.broker  # the scheduler sends through the app
        try:
            beat = beat_for(app, args)
        except ValueError as exc:  # an invalid beat_schedule
            return _say(str(exc), status=2)
        beat.start()
    try:
        return asyncio.run(WorkerService(config, app).run())
    except ConfigurationError as exc:  # a queue declared otherwise before (an ordered one, say)
        return _say(str(exc), status=2)
    except BrokerUnavailable as exc:  # a refused login or TLS handshake: retrying cannot help
        if args.loglevel.lower() == "debug":
            traceback.print_exc()
        return _say(str(exc))
    finally:
        if beat is not None:
            beat.stop()  # hands over (saving the schedule's state) before the worker exits


def _say(message: str, *, status: int = 1) -> int:
    # A start-up error as a good CLI gives it: one line on stderr, and the exit status.
    print(f"clockwork-worker: error: {message}", file=sys.stderr)  # noqa: T201 - no logging for this
    return status


if __name__ == "__main__":
    sys.exit(main())
