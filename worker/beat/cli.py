"""``clockwork-beat``: the periodic scheduler as a process of its own (``worker/beat/``).

Run as many as you like, on any hosts: they elect one leader, which fires; the others wait to
take over. ``clockwork-worker -B`` runs the same scheduler inside a worker.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Sequence
from types import FrameType

from broker_svc.app import App
from broker_svc.errors import BrokerUnavailable, ConfigurationError
from broker_svc.logging import configure_logging
from broker_svc.version import add_version_option
from worker.beat.scheduler import Beat
from worker.loader import AppImportFailed, AppNotFound, BadAppSpec, NotAnApp, load_app, use_current_directory

__all__ = ["add_beat_options", "beat_for", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="clockwork-beat", description="Run the Clockwork periodic scheduler."
    )
    add_version_option(parser)
    add_beat_options(parser)
    parser.add_argument("-A", "--app", required=True, help="the app: package.module:app")
    parser.add_argument("-b", "--broker", default=None, help="broker URL (default: the app's)")
    parser.add_argument("-l", "--loglevel", default="info", help="debug, info, warning, error")
    return parser.parse_args(argv)


def add_beat_options(parser: argparse.ArgumentParser) -> None:
    """The scheduler's options, shared by ``clockwork-beat`` and ``clockwork-worker -B``."""
    parser.add_argument(
        "--scheduler-name", default="default",
        help="the scheduler: instances of one name elect one leader and share a journal (default: default)",
    )  # fmt: skip
    parser.add_argument(
        "--beat-lease", type=float, default=10.0,
        help="seconds of the leader's lease: failover takes the broker noticing a dead leader plus this",
    )  # fmt: skip


def beat_for(app: App, args: argparse.Namespace) -> Beat:
    """The scheduler of ``app`` as the options say.

    Raises:
        ValueError: ``beat_schedule`` is invalid.
    """
    return Beat(app, name=args.scheduler_name, lease_s=args.beat_lease)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2: a usage error, 1: another failure)."""
    args = parse_args(argv)
    try:
        configure_logging(args.loglevel)
    except (ConfigurationError, ValueError) as exc:
        return _say(str(exc), status=2)
    use_current_directory()
    try:
        app = load_app(args.app)
        if args.broker:
            app.conf["broker_url"] = args.broker
        beat = beat_for(app, args)
    except (BadAppSpec, AppNotFound, AppImportFailed, NotAnApp, ValueError) as exc:
        return _say(str(exc), status=2)

    def stop(signum: int, frame: FrameType | None) -> None:
        beat.request_stop()  # hand over, then leave

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        beat.run()
    except BrokerUnavailable as exc:
        if args.loglevel.lower() == "debug":
            traceback.print_exc()
        return _say(str(exc))
    finally:
        app.close()
    return 0


def _say(message: str, *, status: int = 1) -> int:
    print(f"clockwork-beat: error: {message}", file=sys.stderr)  # noqa: T201 - no logging for this
    return status


if __name__ == "__main__":
    sys.exit(main())
