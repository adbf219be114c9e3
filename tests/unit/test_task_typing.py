"""mypy sees a task's parameters and result (``Task[P, R]``), in the blocking and the asyncio API."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]

SNIPPET = textwrap.dedent(
    """
    from typing import Any

    from broker_svc import App, Task, shared_task
    from broker_svc.aio import AsyncApp

    app = App("typed")


    @app.task
    def add(x: int, y: int) -> int:
        return x + y


    @app.task(bind=True, max_retries=2)
    def bound(self: Any, name: str) -> str:
        return name


    @shared_task
    def shout(text: str) -> str:
        return text.upper()


    class Base(Task):
        pass


    @app.task(base=Base)
    def based(x: int) -> int:
        return x


    def blocking() -> None:
        total: int = add.delay(1, 2).get(timeout=1)
        called: int = add(1, 2)
        named: str = bound.delay("n").get()
        loud: str = shout.delay("a").get()
        immutable = add.si(1, 2)
        partial = add.s(1)
        based.delay(3)
        add.delay(1, "x")  # E: arg-type
        add(1)  # E: call-arg
        add.si(1, 2, 3)  # E: call-arg
        bound.delay(1)  # E: arg-type
        shout.delay(b"x")  # E: arg-type
        wrong: str = add.delay(1, 2).get()  # E: assignment


    async def asyncio_side(aapp: AsyncApp) -> None:
        result = await aapp.delay(add, 1, 2)
        total: int = await result.get(timeout=1)
        loud: str = await (await aapp.delay(shout, "a")).get()
        await aapp.delay(add, 1, "x")  # E: arg-type
        await aapp.delay(add, 1)  # E: call-arg
        wrong: str = await result.get()  # E: assignment
    """
)


def test_mypy_reports_wrong_task_arguments_and_results_and_nothing_else(tmp_path: pathlib.Path):
    snippet = tmp_path / "typed_tasks.py"
    snippet.write_text(SNIPPET)
    expected = {
        number: re.search(r"# E: ([\w-]+)", line).group(1)  # type: ignore[union-attr]
        for number, line in enumerate(SNIPPET.splitlines(), start=1)
        if "# E:" in line
    }
    run = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--python-version", "3.11", "--no-error-summary",
            "--show-error-codes", "--cache-dir", str(ROOT / ".mypy_cache"), str(snippet),
        ],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    found: dict[int, str] = {}
    for line in run.stdout.splitlines():
        match = re.match(r".*typed_tasks\.py:(\d+): error: .*\[([\w-]+)\]$", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    assert found == expected, run.stdout + run.stderr
