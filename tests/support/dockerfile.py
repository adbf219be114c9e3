"""A Dockerfile read into stages, and its build steps run outside Docker where they can run.

Outside Docker, a stage's filesystem is a directory standing in for ``/`` and its Python a fresh
venv: ``WORKDIR``, ``ENV``, ``COPY`` (from the context or an earlier stage), ``RUN --mount=type=bind``
and the ``pip`` and ``mkdir -p`` commands of ``RUN`` are carried out, with absolute paths put under
the stage's directory; the other commands (``apt-get``, ``useradd``, ...) need root and Debian and
are reported as skipped, never run.
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.packaging import fresh_venv, pip_for, run, shell_commands

__all__ = ["Instruction", "Stage", "StageRun", "build_outside_docker", "exec_form", "flags_of", "read_stages"]


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    args: str  # the rest of the instruction, continuation lines joined
    line: int


@dataclass
class Stage:
    base: str  # the FROM image, build args expanded
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def read_stages(text: str) -> list[Stage]:
    """The stages of a Dockerfile, in order.

    Raises:
        AssertionError: an instruction before the first ``FROM`` other than ``ARG``.
    """
    build_args: dict[str, str] = {}
    stages: list[Stage] = []
    logical, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if logical and line.startswith("#"):
            continue  # a comment inside a continued instruction
        logical, start = (logical + " " + line.removesuffix("\\").strip()).strip(), start or number
        if line.endswith("\\"):
            continue
        keyword, _, args = logical.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip(), start)
        logical, start = "", 0
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: build_args.get(m.group(1), ""), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {start}: {instruction.keyword} before FROM"
            key, _, default = instruction.args.partition("=")
            build_args[key] = default
        else:
            stages[-1].instructions.append(instruction)
    return stages


def exec_form(instruction: Instruction) -> list[str]:
    """The JSON array of a ``CMD``/``ENTRYPOINT`` in exec form."""
    words = json.loads(instruction.args)
    assert isinstance(words, list) and all(isinstance(w, str) for w in words), instruction
    return words


def flags_of(instruction: Instruction) -> tuple[dict[str, str], str]:
    """The leading ``--flag=value`` options of a ``RUN``/``COPY``, and the rest."""
    flags: dict[str, str] = {}
    rest = instruction.args
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        key, _, value = flag[2:].partition("=")
        flags[key] = value
        rest = rest.strip()
    return flags, rest


@dataclass
class StageRun:
    """A stage built outside Docker: its stand-in root, its Python, where it ended up."""

    root: Path
    python: Path
    workdir: str = "/"
    env: dict[str, str] = field(default_factory=dict)
    pip_commands: list[list[str]] = field(default_factory=list)
    skipped: list[list[str]] = field(default_factory=list)

    def path(self, path: str) -> Path:
        """``path`` in the image, as a path under :attr:`root`."""
        return self.root / posixpath.join(self.workdir, path).lstrip("/")


def build_outside_docker(stages: list[Stage], context: Path, into: Path) -> list[StageRun]:
    """Carry out each stage's steps under ``into``, in order (see the module docstring)."""
    runs: list[StageRun] = []
    by_name: dict[str, StageRun] = {}
    for index, stage in enumerate(stages):
        name = stage.name or f"stage{index}"
        step = StageRun(root=into / name, python=fresh_venv(into / f"{name}-venv"))
        step.root.mkdir(parents=True)
        for instruction in stage.instructions:
            if instruction.keyword == "WORKDIR":
                step.workdir = posixpath.join(step.workdir, instruction.args)
                step.path(".").mkdir(parents=True, exist_ok=True)
            elif instruction.keyword == "ENV":
                step.env.update(dict(word.split("=", 1) for word in shlex.split(instruction.args)))
            elif instruction.keyword == "COPY":
                _copy(instruction, step, context, by_name)
            elif instruction.keyword == "RUN":
                _run(instruction, step, by_name)
        runs.append(step)
        by_name[name] = step
    return runs


def _copy(instruction: Instruction, step: StageRun, context: Path, by_name: dict[str, StageRun]) -> None:
    flags, rest = flags_of(instruction)
    *sources, dest = shlex.split(rest)
    source_root = by_name[flags["from"]].root if "from" in flags else context
    target = step.path(dest)
    for source in sources:
        origin = source_root / source.lstrip("/")
        if origin.is_dir():  # Docker copies a directory's contents
            shutil.copytree(origin, target, dirs_exist_ok=True)
        else:
            into = target / origin.name if dest.endswith("/") else target
            into.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, into)


def _run(instruction: Instruction, step: StageRun, by_name: dict[str, StageRun]) -> None:
    flags, command = flags_of(instruction)
    if "mount" in flags:
        mount = dict(part.split("=", 1) for part in flags["mount"].split(","))
        assert mount["type"] == "bind", f"line {instruction.line}: only bind mounts are carried out"
        source = by_name[mount["from"]].root / mount["source"].lstrip("/")
        link = step.path(mount["target"])
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source, target_is_directory=True)
    commands = shell_commands(command)
    # The machine's pip cache stands in for none: what is tested is the steps, not layer sizes.
    env = {**os.environ, **{k: v for k, v in step.env.items() if k != "PIP_NO_CACHE_DIR"}}
    env.pop("PYTHONPATH", None)
    for argv in commands:
        if argv[0] == "pip":
            args = [rooted for word in argv[1:] for rooted in _rooted(word, step)]
            step.pip_commands.append(argv)
            run([*pip_for(step.python), *args], cwd=step.path("."), env=env, timeout_s=300)
        elif argv[:2] == ["mkdir", "-p"]:
            for path in argv[2:]:
                step.path(path).mkdir(parents=True, exist_ok=True)
        else:
            step.skipped.append(argv)


def _rooted(word: str, step: StageRun) -> list[str]:
    # An absolute path (or --option=/path) in the image is a path under the stage's root here; a
    # glob is expanded, as the shell of a RUN would.
    option, equals, value = word.partition("=") if word.startswith("--") else ("", "", word)
    if not value.startswith("/"):
        return [word]
    path = step.path(value)
    if "*" not in value:
        return [f"{option}{equals}{path}"]
    found = sorted(glob.glob(str(path)))
    assert found and not option, f"{word}: matches nothing here"
    return found
