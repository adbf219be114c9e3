"""Run the real Flower (from PyPI) in a subprocess against a broker URL and read its HTTP API."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_for


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FlowerProcess:
    """``celery -b <url> flower`` on a free local port, with its API open (no auth).

    Flower runs with Celery's default app, as an operator would start it: the broker URL is all it
    needs. Its ``/api/*`` endpoints refuse anonymous clients unless ``FLOWER_UNAUTHENTICATED_API``
    is set; its HTML views do not.

    Args:
        broker_url: AMQP URL, vhost included.
        inspect_timeout_ms: How long Flower waits for inspect replies (Flower's own default: 1000).
        extra_args: More ``flower`` options.
    """

    def __init__(
        self, broker_url: str, *, inspect_timeout_ms: int = 1000, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._dir = Path(tempfile.mkdtemp(prefix="flower-"))
        self._log = self._dir / "flower.log"
        self._logfile = self._log.open("w")
        cmd = [
            sys.executable, "-m", "celery", "-b", broker_url, "flower",
            f"--port={self.port}", "--address=127.0.0.1", f"--inspect_timeout={inspect_timeout_ms}",
            "--persistent=False", "--logging=debug", *extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=self._dir,  # Flower's state file (``--db``), should it write one, lands here
            stdout=self._logfile,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FLOWER_UNAUTHENTICATED_API": "true", "PYTHONUNBUFFERED": "1"},
        )

    def log_text(self) -> str:
        return self._log.read_text()

    def wait_ready(self, timeout_s: float = 30.0) -> FlowerProcess:
        """Wait until Flower answers HTTP (``/healthcheck``)."""

        def answers() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"flower exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                return self.get_text("/healthcheck", timeout_s=2) == "OK"
            except (OSError, urllib.error.URLError):
                return False

        wait_for(answers, timeout_s=timeout_s, interval_s=0.1,
                 message=f"flower does not answer HTTP:\n{self.log_text()[-4000:]}")  # fmt: skip
        return self

    def get_text(self, path: str, *, timeout_s: float = 10.0) -> str:
        """GET ``path`` and return the body; raises ``urllib.error.HTTPError`` on 4xx/5xx."""
        with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as resp:
            return str(resp.read().decode())

    def get_json(self, path: str, *, timeout_s: float = 10.0) -> Any:
        return json.loads(self.get_text(path, timeout_s=timeout_s))

    def api_workers(self, *, refresh: bool = False) -> dict[str, dict[str, Any]]:
        """``/api/workers``: ``{node: {stats, registered, active_queues, conf, ...}}`` from inspect replies.

        With ``refresh``, Flower first broadcasts ``stats``, ``active_queues``, ``registered`` and
        ``conf`` and waits ``inspect_timeout`` for the replies.
        """
        result: dict[str, dict[str, Any]] = self.get_json(
            "/api/workers?refresh=1" if refresh else "/api/workers"
        )
        return result

    def api_tasks(self) -> dict[str, dict[str, Any]]:
        """``/api/tasks``: ``{task id: {name, state, worker, ...}}``, built from task events."""
        result: dict[str, dict[str, Any]] = self.get_json("/api/tasks")
        return result

    def event_workers(self) -> dict[str, dict[str, Any]]:
        """What the ``/workers`` page shows (its ``?json=1`` feed): workers known from events, by name."""
        rows = self.get_json("/workers?json=1")["data"]
        return {row["hostname"]: row for row in rows}

    def close(self) -> None:
        """SIGINT (Flower's clean stop), then kill if it lingers; removes the log."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        finally:
            self._logfile.close()
            for path in self._dir.iterdir():
                path.unlink()
            self._dir.rmdir()

    def __enter__(self) -> FlowerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
