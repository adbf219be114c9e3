"""One private RabbitMQ node: its own name, ports, Erlang cookie and data dir; start, stop, rabbitmqctl."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.infra.broker_probe import broker_reachable, port_is_free
from tests.infra.node_setup import (
    DIST_PORT_OFFSET,
    NODE_HOST,
    find_free_amqp_port,
    is_beam_of,
    node_env,
    pid_alive,
    prepare_node_dir,
    stop_node_process,
)
from tests.infra.rabbitmq_tools import (
    RabbitNodeError,
    rabbitmq_script_dir,
    require_script_dir,
    run_rabbitmqctl,
)
from tests.support.waiting import poll

log = logging.getLogger(__name__)

_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class PrivateNode:
    """A single RabbitMQ node of our own, isolated from the shared broker.

    All state lives on disk under ``base_dir`` (pid file, cookie, data), so another process can
    rebuild the object from its fields and stop the node. Create one with :meth:`create`.

    Attributes:
        node_name: Erlang node name, e.g. ``clockwork-5701@localhost``.
        amqp_port: AMQP port on 127.0.0.1.
        dist_port: Erlang distribution port on 127.0.0.1.
        base_dir: Private directory; removed by :meth:`stop`.
        rabbitmq_conf: Contents of the node's ``rabbitmq.conf``, written at every start.
    """

    node_name: str
    amqp_port: int
    dist_port: int
    base_dir: Path
    rabbitmq_conf: str = ""

    @classmethod
    def create(
        cls, *, amqp_port: int | None = None, name_prefix: str = "clockwork", rabbitmq_conf: str = ""
    ) -> PrivateNode:
        """Describe a new node on free ports with a fresh temporary directory (not started).

        Args:
            amqp_port: AMQP port; a free one from ``AMQP_PORT_RANGE`` if None.
            name_prefix: Node name prefix; the port is appended to keep names unique.
            rabbitmq_conf: Contents of ``rabbitmq.conf``.

        Returns:
            The node description.

        Raises:
            RabbitNodeError: No free port pair was found.
        """
        port = amqp_port if amqp_port is not None else find_free_amqp_port()
        base_dir = Path(tempfile.mkdtemp(prefix=f"{name_prefix}-rabbit-{port}-"))
        return cls(
            node_name=f"{name_prefix}-{port}@{NODE_HOST}",
            amqp_port=port,
            dist_port=port + DIST_PORT_OFFSET,
            base_dir=base_dir,
            rabbitmq_conf=rabbitmq_conf,
        )

    @classmethod
    @contextmanager
    def started(cls, *, timeout_s: float = 90.0, rabbitmq_conf: str = "") -> Iterator[PrivateNode]:
        """A new node on free ports, started; stopped and its files removed on the way out."""
        node = cls.create(rabbitmq_conf=rabbitmq_conf)
        try:
            node.start(timeout_s=timeout_s)
            yield node
        finally:
            node.stop()

    @property
    def url(self) -> str:
        """AMQP URL of the node's default vhost, as the default ``guest`` user (loopback only)."""
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"

    @property
    def home_dir(self) -> Path:
        """``HOME`` for the node and its CLI; holds the private Erlang cookie."""
        return self.base_dir / "home"

    @property
    def pid_file(self) -> Path:
        """File where the node writes its beam pid."""
        return self.base_dir / "pid"

    def env(self) -> dict[str, str]:
        """Environment for this node's ``rabbitmq-server`` and ``rabbitmqctl``."""
        return node_env(
            node_name=self.node_name,
            amqp_port=self.amqp_port,
            dist_port=self.dist_port,
            base_dir=self.base_dir,
            home_dir=self.home_dir,
        )

    def pid(self) -> int | None:
        """The beam pid from the pid file, or None if there is none (yet)."""
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def is_running(self) -> bool:
        """Tell whether the node's beam process is alive."""
        pid = self.pid()
        return pid is not None and pid_alive(pid) and is_beam_of(pid, self.node_name)

    def rabbitmqctl(self, *args: str, timeout_s: float = 60.0) -> str:
        """Run this node's ``rabbitmqctl -n <node_name> <args>`` with the node's cookie.

        Args:
            *args: Subcommand and arguments, e.g. ``"list_queues", "name"``.
            timeout_s: Bound on the run.

        Returns:
            Standard output.

        Raises:
            RabbitmqctlError: Non-zero exit or timeout.
            RabbitNodeError: RabbitMQ is not installed.
        """
        command = [str(require_script_dir() / "rabbitmqctl"), "-n", self.node_name]
        return run_rabbitmqctl(command, args, env=self.env(), timeout_s=timeout_s)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the node detached and wait until it is booted and answers AMQP.

        Uses ``rabbitmqctl wait <pidfile>``: right after ``-detached`` the node is not yet in
        epmd, so ``await_startup`` would fail at once (RELIABILITY.md §1.1).

        Args:
            timeout_s: Deadline for the whole start.

        Raises:
            RabbitNodeError: A port is taken, or the node did not come up in time; the message
                carries the tail of the node's logs, and the node is stopped and removed.
        """
        deadline = time.monotonic() + timeout_s
        script_dir = require_script_dir()
        for port in (self.amqp_port, self.dist_port):
            if not port_is_free(port):
                raise RabbitNodeError(f"cannot start {self.node_name}: port {port} on 127.0.0.1 is in use")
        prepare_node_dir(self.base_dir, home_dir=self.home_dir, rabbitmq_conf=self.rabbitmq_conf)
        started = time.monotonic()
        with (self.base_dir / "server.out").open("ab") as output:
            # Own session: a Ctrl-C in the terminal must not reach the node before we stop it.
            subprocess.run(
                [str(script_dir / "rabbitmq-server"), "-detached"],
                env=self.env(),
                cwd=self.base_dir,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
        failure = self._await_boot(deadline)
        if failure is not None:
            tail = self.log_tail()
            self.stop(timeout_s=15.0)
            raise RabbitNodeError(
                f"private RabbitMQ node {self.node_name} (AMQP {self.amqp_port}, dist {self.dist_port}) "
                f"did not start: {failure}\n{tail}"
            )
        log.info(
            "started %s on AMQP port %d in %.1f s", self.node_name, self.amqp_port, time.monotonic() - started
        )

    def _await_boot(self, deadline: float) -> str | None:
        """Wait for boot and the AMQP listener; return what went wrong, or None.

        ``rabbitmqctl wait`` alone would wait out the whole deadline for a pid file that a VM
        dying early (bad config, say) never writes, so an Erlang crash dump ends the wait too.
        """
        remaining = max(1.0, deadline - time.monotonic())
        command = [str(require_script_dir() / "rabbitmqctl"), "-n", self.node_name]
        command += ["wait", "--timeout", str(int(remaining)), str(self.pid_file)]
        crash_dump = self.base_dir / "erl_crash.dump"
        pipe, devnull = subprocess.PIPE, subprocess.DEVNULL
        with subprocess.Popen(command, env=self.env(), stdin=devnull, stdout=pipe, stderr=pipe) as waiter:

            def ended() -> bool:
                return waiter.poll() is not None or crash_dump.exists()

            poll(ended, timeout_s=remaining, interval_s=0.1)
            if waiter.poll() is None:
                waiter.kill()
            output, errors = waiter.communicate()  # a few lines at most: no pipe deadlock
        if crash_dump.exists():
            # The VM writes the dump while dying; its first lines name the cause.
            poll(lambda: b"Slogan:" in crash_dump.read_bytes()[:8192], timeout_s=5.0, interval_s=0.05)
            return "the Erlang VM crashed (see erl_crash.dump below)"
        if waiter.returncode != 0:
            said = (errors or output).decode(errors="replace").strip()[-1000:]
            return f"`rabbitmqctl wait` exited with status {waiter.returncode}: {said}"
        remaining = max(0.0, deadline - time.monotonic())
        if not poll(lambda: broker_reachable(self.url, timeout_s=1.0), timeout_s=remaining, interval_s=0.1):
            return f"booted, but nothing answered AMQP on port {self.amqp_port}"
        return None

    def stop(self, timeout_s: float = 30.0, *, keep_files: bool = False) -> None:
        """Stop the node (``rabbitmqctl stop``, then SIGKILL) and remove its directory.

        Safe to call on a node that never started or is already stopped.

        Args:
            timeout_s: Time for a graceful stop before SIGKILL.
            keep_files: Keep ``base_dir`` (data, cookie, logs), e.g. to restart the node.

        Raises:
            RabbitNodeError: The beam process survived SIGKILL.
        """
        pid = self.pid()
        if pid is not None and pid_alive(pid) and is_beam_of(pid, self.node_name):
            script_dir = rabbitmq_script_dir()
            graceful = None
            if script_dir is not None:
                # With the pid file, `rabbitmqctl stop` returns only once the OS process is gone.
                graceful = [str(script_dir / "rabbitmqctl"), "-n", self.node_name, "stop", str(self.pid_file)]
            stop_node_process(pid, graceful=graceful, env=self.env(), timeout_s=timeout_s)
            log.info("stopped %s", self.node_name)
        if not keep_files:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Return the last lines of the node's startup output and log, for error messages.

        Args:
            lines: Lines to keep from each file.

        Returns:
            The text, with a header per file.
        """
        files = [
            self.base_dir / "server.out",
            self.base_dir / "log" / f"{self.node_name}.log",
            self.base_dir / "erl_crash.dump",
        ]
        chunks = []
        for path in files:
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError:
                continue
            if not text:
                continue
            # A crash dump's first lines (the "Slogan") say why the VM died; the rest is noise.
            kept = text[:3] if path.name == "erl_crash.dump" else text[-lines:]
            chunks.append(f"--- {path} ---\n" + "\n".join(kept))
        return "\n".join(chunks) or f"(nothing logged under {self.base_dir})"
