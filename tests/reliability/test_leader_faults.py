"""Leader election under faults (RELIABILITY.md, L1-L2): no two terms ever overlap.

L1 runs on the local broker in a vhost of its own (the faults are the candidates': SIGKILL,
SIGSTOP, a connection closed by the broker, SIGTERM). L2 runs on the 3-node cluster and adds a
partition of the leader's node. Each journals every term and checks for overlaps afterwards.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.infra.cluster import RabbitCluster
from tests.infra.session_broker import SessionBroker
from tests.reliability.journal import report
from tests.reliability.leader_cycles import Cycles, summary
from tests.reliability.leader_journal import check
from tests.support.leaders import Candidates

LEASE_S = 2.0
HEARTBEAT_S = 1


@pytest.fixture(scope="module")
def vhost_url(session_broker: SessionBroker) -> Iterator[str]:
    if session_broker.rabbitmqctl is None:
        pytest.fail("this test needs rabbitmqctl for the broker (to close connections from its side)")
    with session_broker.own_vhost("clockwork-leader-faults") as url:
        yield url


def _connection_pids(ctl, vhost: str, holder_pid: int) -> list[str]:
    out = ctl("list_connections", "-p", vhost, "-q", "--no-table-headers", "pid", "client_properties")
    return [line.split("\t", 1)[0] for line in out.splitlines() if f".{holder_pid}." in line]


@pytest.mark.parametrize(
    "cycles",
    [
        pytest.param(4, id="4-cycles"),
        pytest.param(100, id="100-cycles", marks=[pytest.mark.chaos, pytest.mark.timeout(1800)]),
    ],
)
def test_no_two_leaders_overlap_through_kill_freeze_disconnect_and_sigterm(
    session_broker: SessionBroker, vhost_url: str, tmp_path: Path, cycles: int
):
    ctl = session_broker.rabbitmqctl
    assert ctl is not None
    vhost = unquote(urlsplit(vhost_url).path[1:]) or "/"
    candidates = Candidates(
        vhost_url, f"faults-{uuid.uuid4().hex[:8]}", tmp_path, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S
    )

    def disconnect(name: str) -> None:
        pids = _connection_pids(ctl, vhost, candidates.processes[name].pid)
        assert pids, f"no connection of {name}"
        for pid in pids:
            ctl("close_connection", pid, "leader test: forced disconnect")

    run = Cycles(candidates, disconnect)
    try:
        candidates.spawn(3)
        faults = itertools.cycle(["kill", "freeze", "disconnect", "term"])
        for _ in range(cycles):
            run.run(next(faults))
    finally:
        candidates.close()
    verdict = check(tmp_path)
    report("L1", terms=verdict.terms, overlaps=len(verdict.overlaps), acts_outside=verdict.acts_outside,
           lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S, failover=summary(run.failover_s))  # fmt: skip
    assert verdict.ok, verdict
    assert verdict.terms >= cycles + 1


@pytest.mark.parametrize(
    "cycles",
    [
        pytest.param(2, id="2-cycles"),
        pytest.param(100, id="100-cycles", marks=[pytest.mark.chaos, pytest.mark.timeout(1800)]),
    ],
)
@pytest.mark.alone  # a 3-node cluster: `make test` runs it after the rest, in one process
def test_no_two_leaders_overlap_on_the_cluster_through_partition_kill_and_disconnect(
    fault_cluster: RabbitCluster, tmp_path: Path, cycles: int
):
    cluster = fault_cluster
    role = f"cluster-{uuid.uuid4().hex[:8]}"
    groups = [
        Candidates(cluster.failover_url_from(i), role, tmp_path, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S)
        for i in range(3)
    ]
    # One journal directory, one name sequence: candidate i connects to node i first.
    candidates = groups[0]
    urls = [cluster.failover_url_from(i) for i in range(3)]
    partitioned: list[int] = []

    def node_of(name: str) -> int:
        # list_connections is cluster-wide: the server port of the connection names its node.
        pid = candidates.processes[name].pid
        node = next(n for n in cluster.nodes if n.is_running())
        out = node.rabbitmqctl("list_connections", "-q", "--no-table-headers", "port", "client_properties")
        ports = [int(line.split("\t", 1)[0]) for line in out.splitlines() if f".{pid}." in line]
        assert ports, f"{name} has no connection"
        return next(i for i, n in enumerate(cluster.nodes) if n.amqp_port == ports[0])

    def disconnect(name: str) -> None:
        i = node_of(name)
        for pid in _connection_pids(cluster.nodes[i].rabbitmqctl, "/", candidates.processes[name].pid):
            cluster.nodes[i].rabbitmqctl("close_connection", pid, "leader test: forced disconnect")

    def partition(name: str) -> None:
        i = node_of(name)
        partitioned.append(i)
        cluster.partition(i)

    def heal() -> None:
        cluster.heal(partitioned.pop())

    spawned = 0

    def spawn(count: int = 1) -> list[str]:
        nonlocal spawned
        names = []
        for _ in range(count):
            candidates.url = urls[spawned % 3]
            spawned += 1
            names += Candidates.spawn(candidates, 1)
        return names

    candidates.spawn = spawn  # type: ignore[method-assign]
    run = Cycles(candidates, disconnect, partition, heal)
    try:
        spawn(3)
        faults = itertools.cycle(["partition", "kill", "disconnect", "freeze", "term"])
        for _ in range(cycles):
            run.run(next(faults))
    finally:
        candidates.close()
        while partitioned:
            heal()
    verdict = check(tmp_path)
    report("L2", terms=verdict.terms, overlaps=len(verdict.overlaps), acts_outside=verdict.acts_outside,
           lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S, failover=summary(run.failover_s))  # fmt: skip
    assert verdict.ok, verdict
    assert verdict.terms >= cycles + 1
