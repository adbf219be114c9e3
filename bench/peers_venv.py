"""The peers' virtualenv (``.bench-peers/``): Celery and Dramatiq from PyPI, never in the project venv.

Created on first use and reinstalled when ``bench/peers/requirements.txt`` changes (a copy of the
installed file is kept in the venv as the stamp).
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS_VENV = ROOT / ".bench-peers"
REQUIREMENTS = ROOT / "bench" / "peers" / "requirements.txt"
_STAMP = "bench-requirements.txt"

# The distributions whose versions the report prints.
PEER_DISTRIBUTIONS = ("celery", "kombu", "amqp", "billiard", "dramatiq", "pika")


def peers_python(path: Path = PEERS_VENV) -> Path:
    """The peers venv's interpreter (it may not exist yet)."""
    return path / "bin" / "python"


def ensure_peers_venv(path: Path = PEERS_VENV) -> Path:
    """Create or update the peers venv; return its interpreter.

    Raises:
        subprocess.CalledProcessError: pip could not install the requirements.
    """
    python = peers_python(path)
    stamp = path / _STAMP
    wanted = REQUIREMENTS.read_text()
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    if not python.exists():
        print(f"bench: creating the peers' virtualenv in {path}", file=sys.stderr, flush=True)
        # The venv module bases a venv created from inside another venv on the real interpreter.
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    print(f"bench: installing {REQUIREMENTS.relative_to(ROOT)} into {path}", file=sys.stderr, flush=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "-r", str(REQUIREMENTS)], check=True
    )
    stamp.write_text(wanted)
    return python


def versions(python: Path | str, distributions: tuple[str, ...]) -> dict[str, str]:
    """Installed versions of ``distributions`` in the environment of ``python`` (missing ones left out).

    Raises:
        subprocess.CalledProcessError: the interpreter failed.
    """
    script = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [str(python), "-c", script, *distributions], check=True, capture_output=True, text=True
    )
    found: dict[str, str] = json.loads(done.stdout)
    return found
