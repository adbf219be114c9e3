"""A 3-node RabbitMQ cluster on one host, with fault injection (RELIABILITY.md §1.2-§1.3).

Each node is a :class:`PrivateNode` with its own directory, ports and ``HOME``; all homes hold
the same Erlang cookie, which also keeps the cluster from ever talking to the shared node. This
module builds, starts, checks and tears the cluster down (a full restart included); the faults
(kill/start, freeze/thaw, partition, alarms, forced disconnects, leader moves) and the queue
inspection are the methods of :class:`~tests.infra.cluster_faults.ClusterFaults`, its mixin.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from tests.infra.broker_probe import broker_reachable
from tests.infra.cluster_faults import ClusterFaults
from tests.infra.node_setup import (
    AMQP_PORT_RANGE,
    DIST_PORT_OFFSET,
    NODE_HOST,
    find_free_amqp_port,
    prepare_node_dir,
    write_erlang_cookie,
)
from tests.infra.private_node import PrivateNode
from tests.infra.rabbitmq_tools import (
    RabbitmqctlError,
    RabbitNodeError,
    ensure_rabbitmq_installed,
    require_script_dir,
)
from tests.support.waiting import poll

__all__ = ["RabbitCluster", "shared_cluster"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _boot(node: PrivateNode, *, timeout_s: float) -> None:
    """Start ``node`` detached and wait until it is booted and answers AMQP.

    Unlike :meth:`PrivateNode.start` there is no "port is free" check: a SIGKILLed node leaves
    its distribution connections in TIME_WAIT for a minute, which blocks a plain ``bind`` but
    not the beam (it listens with SO_REUSEADDR). Nor are the node's files removed on failure:
    they hold the cluster's data.

    Raises:
        RabbitNodeError: it did not boot within ``timeout_s``; the message carries its log tail.
    """
    deadline = time.monotonic() + timeout_s
    script_dir = require_script_dir()
    prepare_node_dir(node.base_dir, home_dir=node.home_dir, rabbitmq_conf=node.rabbitmq_conf)
    with (node.base_dir / "server.out").open("ab") as output:
        subprocess.run(
            [str(script_dir / "rabbitmq-server"), "-detached"],
            env=node.env(),
            cwd=node.base_dir,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal must not reach the node
            timeout=max(1.0, deadline - time.monotonic()),
            check=False,
        )
    # `wait <pidfile>`, not `await_startup`: right after -detached the node is not in epmd yet.
    wait_s = int(max(1.0, deadline - time.monotonic()))
    try:
        node.rabbitmqctl("wait", "--timeout", str(wait_s), str(node.pid_file), timeout_s=wait_s + 10)
    except RabbitmqctlError as exc:
        raise RabbitNodeError(f"{node.node_name} did not boot: {exc}\n{node.log_tail()}") from exc
    remaining = max(0.0, deadline - time.monotonic())
    if not poll(lambda: broker_reachable(node.url, timeout_s=1.0), timeout_s=remaining, interval_s=0.1):
        raise RabbitNodeError(f"{node.node_name} booted, but nothing answers AMQP on port {node.amqp_port}")


@dataclass
class RabbitCluster(ClusterFaults):
    """Three clustered private nodes; ``i`` in the methods is a node index 0..2.

    Create with :meth:`create`, then :meth:`start` (cold start about 24 s on 2 cores: do it once
    per session) and :meth:`close` at the end (stops every node and deletes its files).

    Attributes:
        nodes: The nodes; ``nodes[0]`` is the one the others joined.
        cookie: The shared Erlang cookie.
        base_dir: Parent directory of the nodes' directories.
    """

    nodes: list[PrivateNode]
    cookie: str
    base_dir: Path
    _frozen: set[int] = field(default_factory=set)
    _partitioned: set[int] = field(default_factory=set)
    _alarms: set[str] = field(default_factory=set)

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls, *, size: int = 3, name_prefix: str = "cwcluster", rabbitmq_conf: str = ""
    ) -> RabbitCluster:
        """Describe a cluster on free ports in a fresh temporary directory (not started).

        Ports come from ``AMQP_PORT_RANGE`` (never 5672), each with a free distribution port.

        Raises:
            RabbitNodeError: no free port pairs, or RabbitMQ is not installed.
        """
        ensure_rabbitmq_installed()
        base_dir = Path(tempfile.mkdtemp(prefix=f"{name_prefix}-"))
        cookie = os.urandom(20).hex().upper()
        ports: list[int] = []
        while len(ports) < size:
            port = find_free_amqp_port([p for p in AMQP_PORT_RANGE if p not in ports])
            ports.append(port)
        nodes = []
        for index, port in enumerate(ports):
            node_dir = base_dir / f"n{index}"
            node_dir.mkdir()
            node = PrivateNode(
                node_name=f"{name_prefix}-{port}@{NODE_HOST}",
                amqp_port=port,
                dist_port=port + DIST_PORT_OFFSET,
                base_dir=node_dir,
                rabbitmq_conf=rabbitmq_conf,
            )
            write_erlang_cookie(node.home_dir, cookie)  # one cookie: the nodes may talk to each other
            nodes.append(node)
        return cls(nodes=nodes, cookie=cookie, base_dir=base_dir)

    def start(self, timeout_s: float = 120.0) -> None:
        """Boot every node (in parallel) and join nodes 1.. to node 0.

        Raises:
            RabbitNodeError: a node did not boot or join; every node is stopped again.
        """
        started = time.monotonic()
        try:
            self._each(lambda node: _boot(node, timeout_s=timeout_s))
            seed = self.nodes[0].node_name
            for node in self.nodes[1:]:
                for args in (("stop_app",), ("reset",), ("join_cluster", seed), ("start_app",)):
                    node.rabbitmqctl(*args, timeout_s=timeout_s)
            self.wait_healthy(timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise
        log.info("cluster of %d started in %.1f s", len(self.nodes), time.monotonic() - started)

    def close(self) -> None:
        """Stop every node (thawing frozen ones first) and delete the cluster's files."""
        for index in list(self._frozen):
            self.thaw(index)
        try:
            # All at once: the data is deleted anyway, and a sequential stop costs ~4 s a node.
            self._each(lambda node: node.stop(timeout_s=30.0, keep_files=True))
        finally:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def stop_all(self, timeout_s: float = 60.0) -> None:
        """Stop every node gracefully, keeping their data (for :meth:`up`)."""
        for node in reversed(self.nodes):
            node.stop(timeout_s=timeout_s, keep_files=True)

    def up(self, timeout_s: float = 180.0) -> None:
        """Start every stopped node again with its data; they boot together (each waits for peers).

        Raises:
            RabbitNodeError: a node did not boot in time.
        """
        self._each(
            lambda node: self._restart(node, timeout_s), only=[n for n in self.nodes if not n.is_running()]
        )
        self.wait_healthy(timeout_s=timeout_s)

    # -- addresses -------------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """One AMQP URL per node (default vhost, guest over loopback)."""
        return [node.url for node in self.nodes]

    @property
    def failover_url(self) -> str:
        """All node URLs joined with ``;`` (kombu's failover style), node 0 first."""
        return ";".join(self.urls)

    def failover_url_from(self, first: int) -> str:
        """The failover URL starting at node ``first``, then the next ones round the ring (1 -> 1,2,0)."""
        order = [(first + k) % len(self.nodes) for k in range(len(self.nodes))]
        return ";".join(self.nodes[i].url for i in order)

    # -- health ----------------------------------------------------------------------------------

    def running_nodes(self, i: int | None = None) -> list[str]:
        """Running cluster members as node ``i`` (default: any live node) sees them."""
        out = self._ctl("cluster_status", "--formatter", "json", node=i)
        status = json.loads(out)
        return sorted(status.get("running_nodes", []))

    def healthy(self) -> bool:
        """Every node is up and sees all nodes running, with no partition recorded."""
        names = sorted(n.node_name for n in self.nodes)
        for i in range(len(self.nodes)):
            if i in self._frozen or i in self._partitioned or not self.nodes[i].is_running():
                return False
            try:
                status = json.loads(self._ctl("cluster_status", "--formatter", "json", node=i))
            except (RabbitmqctlError, ValueError):
                return False
            if sorted(status.get("running_nodes", [])) != names or status.get("partitions"):
                return False
        return True

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Wait until :meth:`healthy`.

        Raises:
            RabbitNodeError: not healthy within ``timeout_s``.
        """
        if not poll(self.healthy, timeout_s=timeout_s, interval_s=0.5):
            raise RabbitNodeError(f"cluster not healthy after {timeout_s:g} s: {self.describe()}")

    def restore(self, timeout_s: float = 180.0) -> None:
        """Undo any fault left behind (thaw, heal, clear alarms, start dead nodes) and wait healthy.

        For a test's ``finally``: the next test gets a cluster of 3 running nodes.
        """
        for i in list(self._frozen):
            self.thaw(i)
        for i in list(self._partitioned):
            self.heal(i, timeout_s=timeout_s)
        dead = [node for node in self.nodes if not node.is_running()]
        if dead:
            self._each(lambda node: self._restart(node, timeout_s), only=dead)
        # Alarms are switched off only if a test raised one (each call costs a CLI run per node).
        if "memory" in self._alarms:
            self.memory_alarm(False)
        if "disk" in self._alarms:
            self.disk_alarm(False)
        self.wait_healthy(timeout_s=timeout_s)

    def describe(self) -> str:
        """One line per node: running or not, frozen, partitioned, and what it sees."""
        lines = []
        for i, node in enumerate(self.nodes):
            state = "running" if node.is_running() else "down"
            if i in self._frozen:
                state += ", frozen"
            if i in self._partitioned:
                state += ", partitioned"
            seen = ""
            if state == "running":
                try:
                    seen = f" sees {self.running_nodes(i)}"
                except (RabbitmqctlError, ValueError) as exc:
                    seen = f" (cluster_status failed: {str(exc)[-200:]})"
            lines.append(f"[{i}] {node.node_name} port {node.amqp_port}: {state}{seen}")
        return "; ".join(lines)

    # -- helpers ---------------------------------------------------------------------------------

    def _ctl(self, *args: str, node: int | None = None, timeout_s: float = 30.0) -> str:
        """``rabbitmqctl`` on node ``node``, or on the first node that is up, not frozen, not cut off."""
        if node is None:
            usable = [
                i
                for i, n in enumerate(self.nodes)
                if i not in self._frozen and i not in self._partitioned and n.is_running()
            ]
            if not usable:
                raise RabbitNodeError(f"no usable node for rabbitmqctl {args[0]}: {len(self.nodes)} down")
            node = usable[0]
        return self.nodes[node].rabbitmqctl(*args, timeout_s=timeout_s)

    def _restart(self, node: PrivateNode, timeout_s: float) -> None:
        # A pid file left by a killed beam would make `rabbitmqctl wait` watch the dead pid.
        node.pid_file.unlink(missing_ok=True)
        _boot(node, timeout_s=timeout_s)

    def _each(
        self, action: Callable[[PrivateNode], _T], *, only: Sequence[PrivateNode] | None = None
    ) -> list[_T]:
        """Run ``action`` on each node in parallel threads; the first error is raised after all finish."""
        targets = list(self.nodes if only is None else only)
        if not targets:
            return []
        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            futures = [pool.submit(action, node) for node in targets]
        return [future.result() for future in futures]


_shared: RabbitCluster | None = None
_shared_users = 0
_shared_lock = threading.Lock()


@contextmanager
def shared_cluster() -> Iterator[RabbitCluster]:
    """One started cluster per test process, however many session fixtures ask for it.

    The cold start is the expensive part (about 20 s here), so the infrastructure test and the
    reliability tests share one cluster; it is closed when the last user is done, and at exit if
    the process is interrupted before that.

    Raises:
        RabbitNodeError: the cluster could not be started.
    """
    global _shared, _shared_users
    with _shared_lock:
        if _shared is None:
            cluster = RabbitCluster.create()
            cluster.start()
            atexit.register(_close_shared)
            _shared = cluster
        _shared_users += 1
        cluster = _shared
    try:
        yield cluster
    finally:
        with _shared_lock:
            _shared_users -= 1
            last = _shared_users == 0
        if last:
            _close_shared()


def _close_shared() -> None:
    global _shared
    with _shared_lock:
        cluster, _shared = _shared, None
    if cluster is not None:
        cluster.close()
