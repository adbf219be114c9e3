"""What a fresh interpreter has imported after some code: for the tests that keep start paths lean."""

from __future__ import annotations

import json
import subprocess
import sys

__all__ = ["heavy", "loaded_after"]


def loaded_after(code: str) -> set[str]:
    """The names in ``sys.modules`` of a new interpreter once it has run ``code``."""
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.splitlines()[-1]))


def heavy(loaded: set[str], names: tuple[str, ...]) -> list[str]:
    """Which of ``loaded`` are ``names`` or inside them."""
    return sorted(m for m in loaded for name in names if m == name or m.startswith(f"{name}."))
