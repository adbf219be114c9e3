"""Find a reachable RabbitMQ for tests and ``make``, or start a private node; the CLI behind ``make``.

A private node (:class:`PrivateNode`) never touches the shared node (``rabbit@localhost`` on
5672/25672). A cluster class can sit beside it, built from :mod:`tests.infra.node_setup`.

CLI (logs go to stderr, the URL alone to stdout)::

    python -m tests.infra.rabbit_node ensure --state-dir DIR [--owner PID] [--force-private]
    python -m tests.infra.rabbit_node stop --state-dir DIR [--owner PID]

A node started by ``ensure`` is recorded in DIR with its *owners*, the processes using it (``make``
passes its shell's PID). Another ``ensure`` on the same DIR joins the running node, so
``make worker`` and ``make run`` in two terminals share one broker; ``stop --owner`` stops the node
only when no live owner is left, and ``stop`` without ``--owner`` stops it unconditionally.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from tests.infra.broker_probe import LOCAL_BROKER_URL, LOOPBACK_HOSTS, broker_reachable, redact_url
from tests.infra.node_setup import pid_alive
from tests.infra.private_node import PrivateNode
from tests.infra.rabbitmq_tools import (
    Rabbitmqctl,
    RabbitmqctlError,
    RabbitNodeError,
    ensure_rabbitmq_installed,
    system_rabbitmqctl_for,
)

__all__ = [
    "LOCAL_BROKER_URL",
    "PrivateNode",
    "RabbitNodeError",
    "Rabbitmqctl",
    "RabbitmqctlError",
    "broker_reachable",
    "ensure_broker",
    "ensure_rabbitmq_installed",
    "load_recorded_node",
    "main",
    "rabbitmqctl_for",
    "stop_recorded_node",
]

log = logging.getLogger(__name__)

BROKER_URL_ENV_VARS = ("CLOCKWORK_BROKER_URL", "AMQP_URL")
_RECORD = "node.json"
_LOCK = "lock"


@contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialise ``ensure``/``stop`` calls on one state dir (two terminals running ``make``)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with (state_dir / _LOCK).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_record(state_dir: Path, node: PrivateNode, owners: Sequence[int]) -> None:
    fields = {
        "node_name": node.node_name,
        "amqp_port": node.amqp_port,
        "dist_port": node.dist_port,
        "base_dir": str(node.base_dir),
        "rabbitmq_conf": node.rabbitmq_conf,
        "owners": sorted(set(owners)),
    }
    partial = state_dir / f"{_RECORD}.tmp"
    partial.write_text(json.dumps(fields, indent=2) + "\n")
    partial.replace(state_dir / _RECORD)  # atomic: a reader never sees half a record


def _read_record(state_dir: Path) -> tuple[PrivateNode, list[int]] | None:
    try:
        fields = json.loads((state_dir / _RECORD).read_text())
        node = PrivateNode(
            node_name=str(fields["node_name"]),
            amqp_port=int(fields["amqp_port"]),
            dist_port=int(fields["dist_port"]),
            base_dir=Path(fields["base_dir"]),
            rabbitmq_conf=str(fields.get("rabbitmq_conf", "")),
        )
        return node, [int(owner) for owner in fields.get("owners", [])]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_recorded_node(state_dir: Path) -> PrivateNode | None:
    """Return the private node recorded in ``state_dir`` by ``ensure``, if any.

    Args:
        state_dir: The ``--state-dir`` of ``ensure``.

    Returns:
        The node (running or not), or None if nothing readable is recorded.
    """
    record = _read_record(state_dir)
    return record[0] if record is not None else None


def ensure_broker(
    state_dir: Path, *, owner: int, force_private: bool = False, start_timeout_s: float = 90.0
) -> str:
    """Return the URL of a reachable broker, starting (and recording) a private node if needed.

    Order: ``$CLOCKWORK_BROKER_URL`` then ``$AMQP_URL`` if reachable; the running node recorded
    in ``state_dir`` (``owner`` joins its owners); the local broker on 127.0.0.1:5672; else a new
    private node owned by ``owner``.

    Args:
        state_dir: Where a started node is recorded for :func:`stop_recorded_node`.
        owner: PID of the process that will use the broker and later call ``stop``.
        force_private: Skip the environment and the local broker (to test the private path).
        start_timeout_s: Deadline for starting a private node.

    Returns:
        An AMQP URL.

    Raises:
        RabbitNodeError: No broker is reachable and no private node could be started.
    """
    if not force_private:
        for variable in BROKER_URL_ENV_VARS:
            if url := os.environ.get(variable):
                if broker_reachable(url):
                    log.info("using $%s (%s)", variable, redact_url(url))
                    return url
                log.warning("$%s (%s) is not reachable; looking further", variable, redact_url(url))
    with _locked(state_dir):
        if (record := _read_record(state_dir)) is not None:
            node, owners = record
            if node.is_running() and broker_reachable(node.url):
                _write_record(state_dir, node, [*filter(pid_alive, owners), owner])
                log.info("sharing private node %s recorded in %s", node.node_name, state_dir)
                return node.url
            log.info("removing the stale record of %s", node.node_name)
            node.stop()
            (state_dir / _RECORD).unlink()
        if not force_private and broker_reachable(LOCAL_BROKER_URL):
            log.info("using the local broker at 127.0.0.1:5672")
            return LOCAL_BROKER_URL
        ensure_rabbitmq_installed()
        node = PrivateNode.create()
        _write_record(state_dir, node, [owner])  # before starting: an interrupted start can be stopped
        log.info(
            "starting private node %s on port %d (data in %s)", node.node_name, node.amqp_port, node.base_dir
        )
        try:
            node.start(timeout_s=start_timeout_s)
        except BaseException:
            node.stop(timeout_s=10.0)
            (state_dir / _RECORD).unlink(missing_ok=True)
            raise
        return node.url


def stop_recorded_node(state_dir: Path, *, owner: int | None = None) -> None:
    """Release the private node recorded in ``state_dir``; stop it when nobody else uses it.

    Args:
        state_dir: The ``--state-dir`` of ``ensure``.
        owner: The releasing process; None stops the node whatever its owners.

    Raises:
        RabbitNodeError: The node's process survived SIGKILL.
    """
    with _locked(state_dir):
        if (record := _read_record(state_dir)) is None:
            log.info("no private node recorded in %s; nothing to stop", state_dir)
            return
        node, owners = record
        if owner is not None:
            others = [pid for pid in owners if pid != owner and pid_alive(pid)]
            if others and node.is_running():
                _write_record(state_dir, node, others)
                log.info("leaving %s running: still used by pid %s", node.node_name, others)
                return
        node.stop()
        (state_dir / _RECORD).unlink(missing_ok=True)


def rabbitmqctl_for(url: str, *, state_dir: Path | None = None) -> Rabbitmqctl | None:
    """Find a ``rabbitmqctl`` that administers the broker serving ``url``, if it is on this host.

    Tries the private node recorded in ``state_dir`` by ``ensure`` (its CLI needs the node's
    private cookie), then the plain ``rabbitmqctl`` (see ``system_rabbitmqctl_for``).

    Args:
        url: AMQP URL of the broker.
        state_dir: The ``--state-dir`` of ``ensure``, if any.

    Returns:
        A runner for that node's ``rabbitmqctl``, or None.
    """
    if state_dir is not None and (node := load_recorded_node(state_dir)) is not None:
        parts = urlsplit(url)
        if parts.hostname in LOOPBACK_HOSTS and parts.port == node.amqp_port and node.is_running():
            return node.rabbitmqctl
    return system_rabbitmqctl_for(url)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if None.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tests.infra.rabbit_node", description="Find or start a RabbitMQ broker for Clockwork."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    ensure = commands.add_parser(
        "ensure", help="print a reachable broker's URL; start a private node if needed"
    )
    ensure.add_argument(
        "--force-private", action="store_true", help="ignore $CLOCKWORK_BROKER_URL/$AMQP_URL, 5672"
    )
    ensure.add_argument("--start-timeout", type=float, default=90.0, help="seconds (default: %(default)s)")
    stop = commands.add_parser(
        "stop", help="release (--owner) or stop the private node recorded in --state-dir"
    )
    for command in (ensure, stop):
        command.add_argument("--state-dir", type=Path, required=True, help="where a started node is recorded")
    ensure.add_argument(
        "--owner", type=int, default=os.getppid(), help="PID using the broker (default: parent)"
    )
    stop.add_argument(
        "--owner", type=int, default=None, help="PID releasing it (default: stop unconditionally)"
    )
    args = parser.parse_args(argv)

    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="rabbit_node: %(levelname)s %(message)s"
    )
    try:
        if args.command == "ensure":
            url = ensure_broker(
                args.state_dir,
                owner=args.owner,
                force_private=args.force_private,
                start_timeout_s=args.start_timeout,
            )
            sys.stdout.write(url + "\n")  # stdout carries the URL only; `make` captures it
        else:
            stop_recorded_node(args.state_dir, owner=args.owner)
    except RabbitNodeError as exc:
        log.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
