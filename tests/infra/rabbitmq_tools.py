"""RabbitMQ's own scripts: find them (bypassing Debian's wrappers), install them, run rabbitmqctl."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from tests.infra.broker_probe import LOOPBACK_HOSTS

log = logging.getLogger(__name__)


class RabbitNodeError(RuntimeError):
    """A broker could not be found, or a private node could not be started, stopped or controlled."""


class RabbitmqctlError(RabbitNodeError):
    """``rabbitmqctl`` exited non-zero or did not finish in time."""


class Rabbitmqctl(Protocol):
    """Runs ``rabbitmqctl`` against one particular node and returns its stdout."""

    def __call__(self, *args: str, timeout_s: float = ...) -> str: ...


def rabbitmq_script_dir() -> Path | None:
    """Find the directory holding the real ``rabbitmq-server`` and ``rabbitmqctl`` scripts.

    Debian's ``/usr/sbin`` versions are wrappers that ``su`` to the ``rabbitmq`` user, ``cd`` to
    /var/lib/rabbitmq and log to /var/log/rabbitmq, so they cannot run a private node. The real
    scripts sit beside ``rabbitmq-env``, which is how they are recognised.

    Returns:
        The directory, or None if RabbitMQ is not installed.
    """
    candidates = [Path("/usr/lib/rabbitmq/bin")]
    if on_path := shutil.which("rabbitmq-server"):
        candidates.append(Path(on_path).resolve().parent)
    candidates += sorted(Path("/usr/lib/rabbitmq/lib").glob("rabbitmq_server-*/sbin"), reverse=True)
    for directory in candidates:
        if all((directory / name).exists() for name in ("rabbitmq-server", "rabbitmqctl", "rabbitmq-env")):
            return directory
    return None


def ensure_rabbitmq_installed() -> Path:
    """Make sure RabbitMQ is installed, installing Debian's package when we are root.

    The package's maintainer scripts would start the system service on 5672 with the system
    cookie; a temporary ``policy-rc.d`` answering 101 ("action forbidden") keeps it stopped, so
    installing for tests does not leave a system broker behind.

    Returns:
        The directory of the real scripts (see :func:`rabbitmq_script_dir`).

    Raises:
        RabbitNodeError: RabbitMQ is missing and cannot be installed from here.
    """
    if (found := rabbitmq_script_dir()) is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RabbitNodeError(
            "rabbitmq-server is not installed. Install it (Debian/Ubuntu: "
            "`sudo apt-get install rabbitmq-server`), or set AMQP_URL / CLOCKWORK_BROKER_URL "
            "to a reachable RabbitMQ."
        )
    log.warning("rabbitmq-server is missing; installing Debian's package with apt-get")
    policy = Path("/usr/sbin/policy-rc.d")
    created_policy = not policy.exists()
    if created_policy:
        policy.write_text("#!/bin/sh\n# Temporary: written by tests/infra/rabbitmq_tools.py.\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", "rabbitmq-server"]):
            # apt's output goes to stderr: the CLI's stdout carries only the broker URL.
            done = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr, check=False)
            if done.returncode != 0:
                raise RabbitNodeError(f"`{' '.join(command)}` failed with exit status {done.returncode}")
    finally:
        if created_policy:
            policy.unlink(missing_ok=True)
    if (found := rabbitmq_script_dir()) is None:
        raise RabbitNodeError("apt-get installed rabbitmq-server, but its scripts were not found")
    return found


def require_script_dir() -> Path:
    """Return :func:`rabbitmq_script_dir`, or raise if RabbitMQ is not installed.

    Raises:
        RabbitNodeError: RabbitMQ is not installed.
    """
    if (found := rabbitmq_script_dir()) is None:
        raise RabbitNodeError("rabbitmq-server is not installed; call ensure_rabbitmq_installed() first")
    return found


def run_rabbitmqctl(
    command: Sequence[str],
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> str:
    """Run ``rabbitmqctl`` and return its stdout.

    Args:
        command: The executable and options that pick the node, e.g. ``[path, "-n", node]``.
        args: The subcommand and its arguments.
        env: Environment (for a private node: its HOME with the cookie); None inherits ours.
        timeout_s: Bound on the whole run.

    Returns:
        Standard output.

    Raises:
        RabbitmqctlError: Non-zero exit, or still running after ``timeout_s``.
    """
    argv = [*command, *args]
    try:
        done = subprocess.run(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RabbitmqctlError(f"`{' '.join(argv)}` did not finish within {timeout_s:g} s") from exc
    if done.returncode != 0:
        output = (done.stderr.strip() or done.stdout.strip())[-2000:]
        raise RabbitmqctlError(f"`{' '.join(argv)}` exited with status {done.returncode}: {output}")
    return done.stdout


def system_rabbitmqctl_for(url: str, *, timeout_s: float = 15.0) -> Rabbitmqctl | None:
    """Return a runner of the plain ``rabbitmqctl`` if it administers the broker serving ``url``.

    Debian's wrapper, run as root, ``su``s to ``rabbitmq`` and so uses
    /var/lib/rabbitmq/.erlang.cookie and the node in /etc/rabbitmq/rabbitmq-env.conf. It is
    accepted only if that node has an AMQP listener on the URL's port, so a URL for some other
    local node (a private one) never gets the shared node's CLI.

    Args:
        url: AMQP URL of the broker.
        timeout_s: Bound on the ``rabbitmqctl status`` probe.

    Returns:
        The runner, or None (remote broker, no CLI, or the CLI controls another node).
    """
    parts = urlsplit(url)
    executable = shutil.which("rabbitmqctl")
    if parts.hostname not in LOOPBACK_HOSTS or executable is None:
        return None
    try:
        status = json.loads(
            run_rabbitmqctl([executable], ["status", "--formatter", "json"], timeout_s=timeout_s)
        )
    except (RabbitmqctlError, ValueError):
        return None
    listeners = status.get("listeners", []) if isinstance(status, dict) else []
    port = parts.port or 5672
    if not any(item.get("protocol") == "amqp" and item.get("port") == port for item in listeners):
        return None

    def system_rabbitmqctl(*args: str, timeout_s: float = 60.0) -> str:
        return run_rabbitmqctl([executable], args, timeout_s=timeout_s)

    return system_rabbitmqctl
