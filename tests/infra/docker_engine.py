"""Whether a Docker engine answers, checked with a raw ``/_ping`` so nothing hangs or leaks."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

_DEFAULT_SOCKETS = ("/var/run/docker.sock", "/run/docker.sock")


def _engine_address() -> tuple[int, str | tuple[str, int]] | None:
    """Find where the engine should listen, as ``(address family, address)``.

    Honours ``DOCKER_HOST`` (``unix://`` or ``tcp://``) like the docker client does, then the
    usual rootful and rootless socket paths.
    """
    docker_host = os.environ.get("DOCKER_HOST", "")
    if docker_host:
        parts = urlsplit(docker_host)
        if parts.scheme == "unix":
            return socket.AF_UNIX, parts.path
        if parts.scheme == "tcp" and parts.hostname:
            return socket.AF_INET, (parts.hostname, parts.port or 2375)
        return None  # ssh:// and npipe:// are not worth supporting for tests
    candidates = list(_DEFAULT_SOCKETS)
    if runtime_dir := os.environ.get("XDG_RUNTIME_DIR"):
        candidates.append(f"{runtime_dir}/docker.sock")
    for path in candidates:
        if Path(path).exists():
            return socket.AF_UNIX, path
    return None


def docker_engine_reachable(timeout_s: float = 3.0) -> bool:
    """Tell whether a Docker engine answers ``GET /_ping`` within ``timeout_s``.

    The docker Python client is not used here: without an engine it leaves an unclosed socket
    behind (a ResourceWarning, which the suite turns into an error), and a missing client
    library or CLI says nothing about whether an engine runs.

    Args:
        timeout_s: Bound on connecting and reading the answer.

    Returns:
        True if the engine answered HTTP 200.
    """
    address = _engine_address()
    if address is None:
        return False
    family, target = address
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(target)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            status_line = sock.recv(64)
    except OSError:
        return False
    return status_line.startswith(b"HTTP/1.") and b" 200 " in status_line
