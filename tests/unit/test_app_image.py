"""examples/docker/ builds a good image of a user's app: two stages, a cached dependency layer, an
init process, not root; its compose file runs RabbitMQ, workers and the scheduler from it.

Read as text and YAML here, so it is checked where Docker is not installed; where Docker Compose
is, ``docker compose config`` must accept the compose file as well.
tests/integration/test_app_image.py runs the build steps and the command outside Docker.
"""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.support.dockerfile import Stage, exec_form, flags_of, read_stages
from tests.support.packaging import console_scripts
from tests.support.workers import ROOT

RECIPE = ROOT / "examples" / "docker"
SHUTDOWN_TIMEOUT_S = 30.0  # the worker's --shutdown-timeout default (worker/__main__.py)


def _stages() -> list[Stage]:
    return read_stages((RECIPE / "Dockerfile").read_text())


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((RECIPE / "docker-compose.yml").read_text())
    return loaded


def _app_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("build") is not None}


def test_wheels_are_built_in_one_stage_and_installed_in_a_slim_one():
    builder, *_, final = _stages()
    assert builder.name == "builder"
    assert final.base.endswith("-slim"), final.base
    assert any(i.args.startswith("pip wheel") for i in builder.all("RUN"))
    installs = [i for i in final.all("RUN") if "pip install" in i.args]
    assert len(installs) == 1
    flags, command = flags_of(installs[0])
    assert "from=builder" in flags["mount"]  # the builder's wheels, not a layer of their own
    assert "--no-index" in command  # nothing but what the builder resolved


def test_dependencies_are_a_layer_before_the_code():
    builder, *_, final = _stages()
    # The builder sees only what names the dependencies: a code change keeps its layers cached.
    copied = [shlex.split(i.args)[:-1] for i in builder.all("COPY")]
    assert sorted(src for sources in copied for src in sources) == ["requirements.txt", "wheels/"]
    steps = [i for i in final.instructions if i.keyword in ("RUN", "COPY")]
    install = next(n for n, i in enumerate(steps) if "pip install" in i.args)
    code = [n for n, i in enumerate(steps) if i.keyword == "COPY"]
    assert code and min(code) > install and max(code) == len(steps) - 1, "the app's code is copied last"
    for step in steps[install + 1 :]:
        assert step.keyword == "COPY" and "--from" not in step.args, step


def test_the_image_runs_as_a_user_that_is_not_root():
    *_, final = _stages()
    users = final.all("USER")
    assert users, "no USER: the worker would run as root"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0")
    assert user.isdigit(), "numeric, so Kubernetes' runAsNonRoot can check it"
    created = " ".join(i.args for i in final.all("RUN"))
    assert f"--uid {user}" in created, "the user exists in the image"
    # The user comes after the last RUN (which needs root) and before the command.
    order = [i.keyword for i in final.instructions]
    assert max(n for n, k in enumerate(order) if k == "RUN") < order.index("USER") < order.index("CMD")


def test_an_init_process_starts_the_command_and_is_installed():
    *_, final = _stages()
    [entrypoint] = final.all("ENTRYPOINT")
    assert exec_form(entrypoint) == ["tini", "--"]  # forwards to the worker alone, not its group (-g)
    assert any(re.search(r"apt-get install .*\btini\b", i.args) for i in final.all("RUN"))


def test_the_image_and_the_compose_file_run_commands_we_install():
    scripts = console_scripts()
    *_, final = _stages()
    [cmd] = final.all("CMD")
    commands = [exec_form(cmd)]
    services = _app_services(_compose())
    commands += [svc["command"] for svc in services.values()]
    commands += [svc["healthcheck"]["test"][1:] for svc in services.values() if "healthcheck" in svc]
    for command in commands:
        assert command[0] in scripts, command
    # Each -A names a module of the example and an app in it.
    for command in commands:
        if "-A" in command:
            module, _, attribute = command[command.index("-A") + 1].partition(":")
            source = RECIPE / (module.replace(".", "/") + ".py")
            assert source.is_file(), source
            assert attribute in _assigned(source), f"{source} defines no {attribute}"


def _assigned(source: Path) -> set[str]:
    assignments = [node for node in ast.parse(source.read_text()).body if isinstance(node, ast.Assign)]
    return {target.id for node in assignments for target in node.targets if isinstance(target, ast.Name)}


def test_compose_runs_rabbitmq_workers_that_stop_gracefully_and_the_scheduler():
    compose = _compose()
    services = _app_services(compose)
    assert "rabbitmq" in compose["services"] and compose["services"]["rabbitmq"]["healthcheck"]
    workers = {n: s for n, s in services.items() if s["command"][0] == "clockwork-worker"}
    beats = [s for s in services.values() if s["command"][0] == "clockwork-beat"]
    assert len(workers) >= 2 and len(beats) == 1
    state_dir = next(
        word.partition("=")[2]
        for i in _stages()[-1].all("ENV")
        for word in shlex.split(i.args)
        if word.startswith("CLOCKWORK_STATE_DIR=")
    )
    named = set(compose["volumes"])
    for name, svc in services.items():
        assert svc["build"] == ".", name  # the Dockerfile beside it
        assert svc["depends_on"]["rabbitmq"]["condition"] == "service_healthy", name
        assert svc["environment"]["CLOCKWORK_BROKER_URL"].startswith("${CLOCKWORK_BROKER_URL:-"), name
    for name, worker in workers.items():
        grace = re.fullmatch(r"(\d+)s", worker["stop_grace_period"])
        assert grace and float(grace.group(1)) > SHUTDOWN_TIMEOUT_S, name
        [volume] = worker["volumes"]
        assert volume.split(":")[0] in named and volume.endswith(f":{state_dir}"), name
        command = worker["command"]
        node = command[command.index("-n") + 1]
        assert "%h" not in node and node in worker["healthcheck"]["test"], name
    assert len({w["volumes"][0] for w in workers.values()}) == len(workers)  # none shares a state


def test_docker_accepts_the_compose_file_where_docker_compose_exists():
    docker = shutil.which("docker")
    has_compose = docker is not None and (
        subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0
    )
    if docker is None or not has_compose:
        # No Docker Compose here: the checks above are the check (see the module doc).
        assert _compose()["services"]
        return
    result = subprocess.run(
        [docker, "compose", "-f", str(RECIPE / "docker-compose.yml"), "config", "-q"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
