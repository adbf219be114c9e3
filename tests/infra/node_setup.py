"""Building blocks of one private RabbitMQ node: ports, files, environment, process control.

Kept apart from :class:`tests.infra.rabbit_node.PrivateNode` so a cluster class can reuse them:
its nodes share one cookie (write the same value with :func:`write_erlang_cookie` into each
node's home before starting) and join with ``rabbitmqctl``.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tests.infra.broker_probe import port_is_free
from tests.infra.rabbitmq_tools import RabbitNodeError
from tests.support.waiting import poll

log = logging.getLogger(__name__)

NODE_HOST = "localhost"  # resolves to 127.0.0.1 everywhere, unlike `hostname -s`
DIST_PORT_OFFSET = 20000  # RabbitMQ's own convention: AMQP 5672 -> distribution 25672
AMQP_PORT_RANGE = range(5700, 5800)


def find_free_amqp_port(candidates: Iterable[int] = AMQP_PORT_RANGE) -> int:
    """Pick an AMQP port whose distribution port (``+DIST_PORT_OFFSET``) is free too.

    Candidates are tried in random order so parallel sessions rarely race for one port.

    Args:
        candidates: Ports to consider.

    Returns:
        A free AMQP port.

    Raises:
        RabbitNodeError: Every candidate pair is taken.
    """
    ports = list(candidates)
    random.shuffle(ports)
    for port in ports:
        if port_is_free(port) and port_is_free(port + DIST_PORT_OFFSET):
            return port
    raise RabbitNodeError(f"no free AMQP/distribution port pair among {len(ports)} candidates")


def write_erlang_cookie(home_dir: Path, cookie: str | None = None) -> str:
    """Create ``home_dir/.erlang.cookie`` unless it exists, and return the cookie in use.

    Node and CLI find the cookie through ``$HOME``, so both must run with this ``HOME``. A
    private cookie also guarantees a private node can never talk to the system node.

    Args:
        home_dir: Directory used as ``HOME`` for the node and its ``rabbitmqctl``.
        cookie: Value to write; random if None. Cluster nodes must share one value.

    Returns:
        The cookie stored in the file.
    """
    home_dir.mkdir(parents=True, exist_ok=True)
    path = home_dir / ".erlang.cookie"
    if path.exists():
        return path.read_text().strip()
    value = cookie if cookie is not None else os.urandom(20).hex().upper()
    # Created 0400 in one step: Erlang refuses a cookie file that others can read.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
    with os.fdopen(fd, "w") as handle:
        handle.write(value)
    return value


def prepare_node_dir(base_dir: Path, *, home_dir: Path, rabbitmq_conf: str = "") -> None:
    """Write the files a node reads at boot, so nothing under /etc/rabbitmq is used.

    Args:
        base_dir: The node's own directory (data, logs, pid file, configuration).
        home_dir: ``HOME`` holding the cookie (see :func:`write_erlang_cookie`).
        rabbitmq_conf: Contents of ``rabbitmq.conf`` (e.g. ``consumer_timeout = 60000``).
    """
    for directory in (base_dir / "log", base_dir / "mnesia"):
        directory.mkdir(parents=True, exist_ok=True)
    write_erlang_cookie(home_dir)
    (base_dir / "enabled_plugins").write_text("[].\n")  # no management plugin: it would want port 15672
    (base_dir / "rabbitmq-env.conf").write_text("")
    (base_dir / "rabbitmq.conf").write_text(rabbitmq_conf)
    (base_dir / "advanced.config").write_text("[].\n")


def node_env(
    *, node_name: str, amqp_port: int, dist_port: int, base_dir: Path, home_dir: Path
) -> dict[str, str]:
    """Build the environment for a node's ``rabbitmq-server`` and its ``rabbitmqctl``.

    Inherited ``RABBITMQ_*``/``ERL_*`` variables are dropped so a developer's shell (or
    testcontainers' ``RABBITMQ_NODE_PORT``) cannot leak into the node. Everything the node
    would otherwise read from /etc/rabbitmq or /var/lib/rabbitmq points into ``base_dir``, and
    epmd and distribution stay on loopback.

    Args:
        node_name: Full Erlang node name, e.g. ``clockwork-5701@localhost``.
        amqp_port: AMQP listener port (on 127.0.0.1).
        dist_port: Erlang distribution port.
        base_dir: The node's directory (see :func:`prepare_node_dir`).
        home_dir: ``HOME`` holding the cookie.

    Returns:
        A complete environment for ``subprocess``.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(("RABBITMQ_", "ERL_"))}
    env.update(
        HOME=str(home_dir),
        RABBITMQ_NODENAME=node_name,
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(amqp_port),
        RABBITMQ_DIST_PORT=str(dist_port),
        RABBITMQ_MNESIA_BASE=str(base_dir / "mnesia"),
        RABBITMQ_LOG_BASE=str(base_dir / "log"),
        RABBITMQ_PID_FILE=str(base_dir / "pid"),
        RABBITMQ_CONFIG_FILE=str(base_dir / "rabbitmq"),  # the scripts add ".conf"
        RABBITMQ_ADVANCED_CONFIG_FILE=str(base_dir / "advanced.config"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(base_dir / "enabled_plugins"),
        RABBITMQ_CONF_ENV_FILE=str(base_dir / "rabbitmq-env.conf"),  # not /etc/rabbitmq/rabbitmq-env.conf
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        ERL_EPMD_ADDRESS="127.0.0.1",  # matters only if our node is the one that starts epmd
        ERL_CRASH_DUMP=str(base_dir / "erl_crash.dump"),
    )
    return env


def pid_alive(pid: int) -> bool:
    """Tell whether process ``pid`` exists and is not a zombie.

    A detached beam is reparented to PID 1, which in a container may never reap it; a zombie
    still answers ``kill(pid, 0)``, so /proc is consulted where it exists.

    Args:
        pid: Process id.

    Returns:
        True if the process is running.
    """
    if Path("/proc/self").exists():
        try:
            # The state letter follows the parenthesised command name, which may contain spaces.
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return False
        return bool(fields) and fields[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_beam_of(pid: int, node_name: str) -> bool:
    """Tell whether ``pid`` is the node's beam, not an unrelated process that reused a stale pid.

    RabbitMQ 3.10 does not put the node name on the command line (it is set at boot from the
    environment), so the process environment is checked.

    Args:
        pid: Process id from the node's pid file.
        node_name: The node's Erlang name.

    Returns:
        True if the process runs with ``RABBITMQ_NODENAME=node_name``, or if that cannot be
        checked here (no /proc, or another user's process).
    """
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc (macOS): trust the pid file
    except OSError:
        return True
    return f"RABBITMQ_NODENAME={node_name}".encode() in environ.split(b"\0")


def stop_node_process(
    pid: int, *, graceful: Sequence[str] | None, env: Mapping[str, str] | None, timeout_s: float
) -> None:
    """Stop a node's beam process: run ``graceful`` first, then SIGKILL what is left.

    Args:
        pid: The beam process id (from the node's pid file).
        graceful: A command that asks the node to stop (``rabbitmqctl stop``); None to kill at once.
        env: Environment for ``graceful`` (the node's, for its cookie).
        timeout_s: Total time allowed before SIGKILL, and again for the kill to take effect.

    Raises:
        RabbitNodeError: The process survived SIGKILL.
    """
    deadline = time.monotonic() + timeout_s
    if graceful is not None:
        try:
            subprocess.run(
                graceful,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=max(1.0, timeout_s - 2),
                check=False,
            )
        except subprocess.TimeoutExpired:
            log.warning("graceful stop of pid %d timed out", pid)
    remaining = max(0.0, deadline - time.monotonic())
    if poll(lambda: not pid_alive(pid), timeout_s=remaining, interval_s=0.1):
        return
    log.warning("pid %d still running after %.0f s; sending SIGKILL", pid, timeout_s)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if not poll(lambda: not pid_alive(pid), timeout_s=timeout_s, interval_s=0.05):
        raise RabbitNodeError(f"pid {pid} survived SIGKILL")
