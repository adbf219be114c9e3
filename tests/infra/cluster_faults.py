"""Fault injection and queue inspection for :class:`~tests.infra.cluster.RabbitCluster` (§1.3).

:class:`ClusterFaults` is a mixin of the cluster: kill/start, freeze/thaw (SIGSTOP/SIGCONT), a
partition made with per-node cookies (no iptables needed), alarms, forced disconnects and leader
moves, plus what the fault tests ask of the broker about queues (leader, consumers, messages).
It is separate from ``cluster.py`` so that module holds only how the cluster is built, started,
checked and torn down; the methods stay on the cluster object, so tests call ``cluster.freeze(1)``.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tests.infra.node_setup import pid_alive
from tests.infra.private_node import PrivateNode
from tests.infra.rabbitmq_tools import RabbitNodeError
from tests.support.waiting import poll

__all__ = ["ClusterFaults"]

# Defaults a test's alarm must be switched back to (RabbitMQ's own defaults, as in §1.3).
_MEMORY_WATERMARK = "0.4"
_DISK_FREE_LIMIT = "50MB"


def _atom(name: str) -> str:
    """An Erlang atom literal (node names hold '-' and '@', so they must be quoted)."""
    return "'" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _binary(text: str) -> str:
    """An Erlang binary literal ``<<"...">>``."""
    return '<<"' + text.replace("\\", "\\\\").replace('"', '\\"') + '">>'


class ClusterFaults:
    """The fault and queue methods of ``RabbitCluster``; ``i`` is a node index 0..2.

    The attributes and methods declared here are the cluster's own (see ``cluster.py``).
    """

    nodes: list[PrivateNode]
    cookie: str
    _frozen: set[int]
    _partitioned: set[int]
    _alarms: set[str]

    if TYPE_CHECKING:

        def wait_healthy(self, timeout_s: float = 120.0) -> None: ...

        def _ctl(self, *args: str, node: int | None = None, timeout_s: float = 30.0) -> str: ...

        def _restart(self, node: PrivateNode, timeout_s: float) -> None: ...

    # -- faults ----------------------------------------------------------------------------------

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``'s beam and wait until it is gone."""
        node = self.nodes[i]
        pid = node.pid()
        if pid is None:
            raise RabbitNodeError(f"{node.node_name} has no pid file")
        os.kill(pid, signal.SIGKILL)
        if not poll(lambda: not pid_alive(pid), timeout_s=30.0, interval_s=0.05):
            raise RabbitNodeError(f"{node.node_name} (pid {pid}) survived SIGKILL")
        self._frozen.discard(i)

    def start_node(self, i: int, timeout_s: float = 120.0) -> None:
        """Start node ``i`` again with its data (after :meth:`kill_node`); it rejoins by itself.

        Raises:
            RabbitNodeError: it did not boot in time.
        """
        self._restart(self.nodes[i], timeout_s)

    def freeze(self, i: int) -> None:
        """SIGSTOP node ``i``'s beam (a GC pause or VM stall): its sockets stay open, it answers nothing."""
        os.kill(self._pid(i), signal.SIGSTOP)
        self._frozen.add(i)

    def thaw(self, i: int) -> None:
        """SIGCONT node ``i``'s beam."""
        os.kill(self._pid(i), signal.SIGCONT)
        self._frozen.discard(i)

    def partition(self, i: int) -> None:
        """Cut node ``i`` off from the others (distribution only; its AMQP port stays open).

        Node ``i`` uses a wrong cookie for each peer and drops the links, so neither side can
        reconnect; the CLI still works because it has its own node name (§1.3).

        Raises:
            RabbitNodeError: node ``i`` still sees a peer afterwards.
        """
        peers = ",".join(_atom(n.node_name) for j, n in enumerate(self.nodes) if j != i)
        expr = (
            f"[begin erlang:set_cookie(N, partitioned), erlang:disconnect_node(N) end || N <- [{peers}]], "
            "nodes()."
        )
        seen = self.nodes[i].rabbitmqctl("eval", expr, timeout_s=30.0).strip()
        self._partitioned.add(i)
        if seen != "[]":
            raise RabbitNodeError(f"{self.nodes[i].node_name} still connected after partition: {seen}")

    def heal(self, i: int, timeout_s: float = 120.0) -> None:
        """Undo :meth:`partition`: real cookie, reconnect, then restart the app on node ``i``.

        The restart clears Mnesia's record of the split (``pause_minority`` is not in use).

        Raises:
            RabbitNodeError: the cluster did not come back to all nodes running.
        """
        node = self.nodes[i]
        peers = ",".join(_atom(n.node_name) for j, n in enumerate(self.nodes) if j != i)
        expr = (
            f"[erlang:set_cookie(N, {_atom(self.cookie)}) || N <- [{peers}]], "
            f"[net_adm:ping(N) || N <- [{peers}]]."
        )
        node.rabbitmqctl("eval", expr, timeout_s=30.0)
        node.rabbitmqctl("stop_app", timeout_s=timeout_s)
        node.rabbitmqctl("start_app", timeout_s=timeout_s)
        self._partitioned.discard(i)
        self.wait_healthy(timeout_s=timeout_s)

    def memory_alarm(self, on: bool, *, nodes: Sequence[int] | None = None) -> None:
        """Raise (watermark 0.00001) or clear (0.4) the memory alarm on ``nodes`` (default all)."""
        value = "0.00001" if on else _MEMORY_WATERMARK
        for i in self._indexes(nodes):
            self.nodes[i].rabbitmqctl("set_vm_memory_high_watermark", value, timeout_s=30.0)
        (self._alarms.add if on else self._alarms.discard)("memory")

    def disk_alarm(self, on: bool, *, nodes: Sequence[int] | None = None) -> None:
        """Raise or clear the disk alarm on ``nodes`` (default all); takes up to ~10 s to show."""
        value = "100000GB" if on else _DISK_FREE_LIMIT
        for i in self._indexes(nodes):
            self.nodes[i].rabbitmqctl("set_disk_free_limit", value, timeout_s=30.0)
        (self._alarms.add if on else self._alarms.discard)("disk")

    def close_all_connections(
        self, reason: str = "test: forced disconnect", *, nodes: Sequence[int] | None = None
    ) -> None:
        """Close every client connection on ``nodes`` (default: every running node).

        ``--global`` means "every vhost" on the node the CLI talks to, so it runs once per node.
        """
        for i in self._indexes(nodes):
            if i not in self._frozen and self.nodes[i].is_running():
                self.nodes[i].rabbitmqctl("close_all_connections", "--global", reason, timeout_s=30.0)

    # -- queues ----------------------------------------------------------------------------------

    def index_of(self, node_name: str) -> int:
        """The index of the node called ``node_name``."""
        for i, node in enumerate(self.nodes):
            if node.node_name == node_name:
                return i
        raise KeyError(node_name)

    def leader_of(self, queue: str, *, vhost: str = "/", node: int | None = None) -> int | None:
        """Index of the node leading quorum queue ``queue``, as node ``node`` (default any live) knows it.

        Asks the local Ra leaderboard (updated at once on an election, without calling the
        leader), falling back to the queue record; so it answers while the old leader is frozen
        or gone. The queue record alone would lag: its update is a Mnesia transaction, which
        waits for a frozen node until the net tick declares it down (60 s). None if unknown.
        """
        expr = (
            f"case rabbit_amqqueue:lookup(rabbit_misc:r({_binary(vhost)}, queue, {_binary(queue)})) of "
            "{ok, Q} -> case amqqueue:get_pid(Q) of "
            "{Name, N} when is_atom(N) -> case ra_leaderboard:lookup_leader(Name) of "
            "{_, Leader} -> Leader; _ -> N end; "
            "P -> node(P) end; "
            "_ -> none end."
        )
        out = self._ctl("eval", expr, node=node).strip().strip("'")
        if out == "none":
            return None
        return self.index_of(out)

    def transfer_leadership(self, queue: str, i: int, *, vhost: str = "/", timeout_s: float = 30.0) -> None:
        """Move quorum queue ``queue``'s leader to node ``i`` and wait until it is there.

        Raises:
            RabbitNodeError: the leader is not on node ``i`` within ``timeout_s``.
        """
        if self.leader_of(queue, vhost=vhost, node=i) == i:
            return
        target = self.nodes[i].node_name
        lookup = f"rabbit_amqqueue:lookup(rabbit_misc:r({_binary(vhost)}, queue, {_binary(queue)}))"
        expr = f"rabbit_quorum_queue:transfer_leadership(element(2, {lookup}), {_atom(target)})."
        self.nodes[i].rabbitmqctl("eval", expr, timeout_s=timeout_s)
        if not poll(
            lambda: self.leader_of(queue, vhost=vhost, node=i) == i, timeout_s=timeout_s, interval_s=0.2
        ):
            raise RabbitNodeError(f"leader of {queue!r} did not move to {target} within {timeout_s:g} s")

    def list_consumers(self, vhost: str, queue: str) -> int:
        """How many consumers the broker has on ``queue`` (cluster-wide)."""
        out = self._ctl("list_consumers", "-p", vhost, "--formatter", "json", "queue_name")
        rows: list[dict[str, Any]] = json.loads(out or "[]")
        return sum(1 for row in rows if row.get("queue_name") == queue)

    def queue_messages(self, queue: str, *, vhost: str = "/") -> int | None:
        """Messages ready + unacked in ``queue``, or None if it is not listed."""
        out = self._ctl("list_queues", "-p", vhost, "--formatter", "json", "name", "messages")
        for row in json.loads(out or "[]"):
            if row.get("name") == queue:
                return int(row.get("messages") or 0)
        return None

    # -- helpers ---------------------------------------------------------------------------------

    def _pid(self, i: int) -> int:
        pid = self.nodes[i].pid()
        if pid is None:
            raise RabbitNodeError(f"{self.nodes[i].node_name} has no pid file")
        return pid

    def _indexes(self, nodes: Sequence[int] | None) -> list[int]:
        return list(range(len(self.nodes))) if nodes is None else list(nodes)
