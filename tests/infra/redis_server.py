"""A private ``redis-server`` for one test run: a free loopback port, a temp dir, no persistence.

Tests never use a Redis the machine runs (6379 or any other): the session starts its own and
stops it at the end. Debian's package provides ``/usr/bin/redis-server``; when it is missing and
we are root, it is installed with apt-get, else the run fails saying how to install it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.waiting import poll

__all__ = ["RedisServer", "private_redis_server"]

_START_TIMEOUT_S = 20.0


class RedisServerError(RuntimeError):
    """The private redis-server could not be started."""


@dataclass
class RedisServer:
    """A private redis-server; ``stop()`` and ``start()`` again on the same port (fault tests)."""

    port: int
    base_dir: Path
    proc: subprocess.Popen[bytes]
    binary: str

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        """Stop the server (its data is gone: nothing is saved)."""
        _stop(self.proc)

    def start(self) -> None:
        """Start it again on its port.

        Raises:
            RedisServerError: it did not answer within 20 s.
        """
        self.proc = _spawn(self.binary, self.port, self.base_dir)
        if not _started(self):
            raise RedisServerError(f"redis-server did not start again on {self.port}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        path = self.base_dir / "redis.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def redis_server_binary() -> str:
    """The redis-server executable, installed from Debian's package when missing and root.

    Raises:
        RedisServerError: none found and none could be installed.
    """
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None
    )
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        install = ["apt-get", "install", "-y", "-q", "redis-server"]
        for steps in ([install], [["apt-get", "update", "-q"], install]):  # the package lists may be stale
            for command in steps:
                subprocess.run(command, check=False, capture_output=True, timeout=600)
            found = shutil.which("redis-server")
            if found:
                return found
    raise RedisServerError("redis-server is not installed: apt-get install redis-server (Debian's package)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def private_redis_server() -> Iterator[RedisServer]:
    """Start a redis-server on a free port of 127.0.0.1, wait for PING, stop and remove it on exit.

    Raises:
        RedisServerError: it did not answer within 20 s (three ports tried).
    """
    binary = redis_server_binary()
    base_dir = Path(tempfile.mkdtemp(prefix="clockwork-redis-"))
    server: RedisServer | None = None
    log = base_dir / "redis.log"
    try:
        for _attempt in range(3):  # another process may take the port between our probe and its bind
            port = _free_port()
            candidate = RedisServer(
                port=port, base_dir=base_dir, proc=_spawn(binary, port, base_dir), binary=binary
            )
            if _started(candidate):
                server = candidate
                break
            candidate.stop()
        if server is None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RedisServerError(f"the private redis-server did not start:\n{tail}")
        yield server
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(base_dir, ignore_errors=True)


def _spawn(binary: str, port: int, base_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(base_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(base_dir / "redis.log"),
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _started(server: RedisServer) -> bool:
    # Up once it answers PING; an exit (its port taken meanwhile) ends the wait at once.
    poll(lambda: server.proc.poll() is not None or _answers_ping(server.port), timeout_s=_START_TIMEOUT_S)
    return server.proc.poll() is None and _answers_ping(server.port)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
