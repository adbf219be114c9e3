"""docker-compose.yml is deployable: volumes, a stop grace above the worker's, healthchecks, stable names.

Read as YAML here, so it is checked where Docker is not installed; where it is, ``docker compose
config`` must accept the file as well.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_TIMEOUT_S = 30.0  # the worker's --shutdown-timeout default (worker/__main__.py)


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def _workers(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in compose["services"].items()
        if "clockwork-worker" in str(svc.get("command"))
    }


def _seconds(value: str) -> float:
    found = re.fullmatch(r"(\d+)(s|m)", value)
    assert found, f"unreadable duration {value!r}"
    return float(found.group(1)) * (60 if found.group(2) == "m" else 1)


def test_rabbitmq_and_every_worker_keep_their_data_in_named_volumes():
    compose = _compose()
    named = set(compose["volumes"])
    rabbit = compose["services"]["rabbitmq"]
    assert any(v.split(":")[0] in named and v.endswith(":/var/lib/rabbitmq") for v in rabbit["volumes"])
    assert rabbit.get("hostname"), "RabbitMQ's data is per node name: it needs a fixed hostname"
    workers = _workers(compose)
    assert len(workers) >= 2
    for name, worker in workers.items():
        state = [v for v in worker["volumes"] if v.endswith(":/var/lib/clockwork")]
        assert state and state[0].split(":")[0] in named, name
        assert worker["environment"]["CLOCKWORK_STATE_DIR"] == "/var/lib/clockwork"
    # No two workers share a state volume.
    assert len({w["volumes"][0] for w in workers.values()}) == len(workers)


def test_workers_get_longer_to_stop_than_their_own_shutdown_timeout():
    for name, worker in _workers(_compose()).items():
        assert _seconds(worker["stop_grace_period"]) > SHUTDOWN_TIMEOUT_S, name


def test_each_worker_has_a_stable_name_and_a_healthcheck_that_pings_that_name():
    for name, worker in _workers(_compose()).items():
        command = " ".join(worker["command"])
        node = re.search(r"-n (\S+)", command)
        assert node and "%h" not in node.group(1), f"{name}: a node name that survives a recreate"
        test = worker["healthcheck"]["test"]
        assert test[:4] == ["CMD", "ctl", "inspect", "ping"] and node.group(1) in test, name


def test_configuration_comes_from_the_environment_and_flower_is_optional():
    compose = _compose()
    for worker in _workers(compose).values():
        assert worker["environment"]["CLOCKWORK_BROKER_URL"].startswith("${CLOCKWORK_BROKER_URL:-")
        assert "$$CLOCKWORK_APP" in " ".join(worker["command"])
    flower = compose["services"]["flower"]
    assert flower["profiles"] == ["flower"]  # off unless asked for


def test_docker_accepts_the_file_where_docker_exists():
    docker = shutil.which("docker")
    has_compose = docker is not None and (
        subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=30, check=False
        ).returncode
        == 0
    )
    if docker is None or not has_compose:
        # No Docker Compose here: the YAML checks above are the check (see the module doc).
        assert _compose()["services"]
        return
    result = subprocess.run(
        [docker, "compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
