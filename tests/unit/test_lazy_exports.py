"""Pool children stay lean: importing what they run loads no AMQP client and no control plane."""

from __future__ import annotations

import subprocess
import sys

import pytest

import broker_svc
import control
import worker


def test_a_pool_child_imports_neither_amqp_client_nor_the_control_plane() -> None:
    # What the forkserver preloads (worker.pool.pool): the child module and the app's module.
    heavy = ("pika", "aio_pika", "aiormq", "control", "worker.service")
    probe = f"import sys, worker.child.main, examples.tasks; print(sorted(set({heavy!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_worker_without_a_metrics_port_never_imports_prometheus_client() -> None:
    # About 3 MiB of PSS (the client and the HTTP server it serves with) in every worker otherwise.
    probe = "import sys, worker.__main__, worker.service; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_every_lazy_export_resolves() -> None:
    for package in (broker_svc, control, worker):
        for name in package.__all__:
            assert getattr(package, name) is not None, (package.__name__, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = worker.nope
