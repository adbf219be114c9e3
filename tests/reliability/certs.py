"""Test certificates made with the ``openssl`` CLI: a CA, a server and client certificate, a rogue CA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    """A certificate and its key (PEM files)."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class TestPki:
    """Everything the TLS tests need, in one directory.

    Attributes:
        ca: the CA the broker trusts for client certificates and that signed its own certificate.
        server: the broker's certificate, valid for ``localhost`` only (not for ``127.0.0.1``).
        client: a client certificate signed by ``ca``.
        rogue_ca: a CA nobody trusts.
        rogue_client: a client certificate signed by ``rogue_ca``.
    """

    __test__ = False  # not a pytest class

    ca: Pair
    server: Pair
    client: Pair
    rogue_ca: Pair
    rogue_client: Pair


def _openssl(*args: str | Path, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("the TLS tests need the openssl command line tool")
    subprocess.run([binary, *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory: Path, name: str) -> Pair:
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
        "-keyout", pair.key, "-out", pair.cert,
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    return pair


def _signed(directory: Path, name: str, ca: Pair, *, extensions: str) -> Pair:
    pair = Pair(directory / f"{name}.pem", directory / f"{name}.key")
    request = directory / f"{name}.csr"
    ext_file = directory / f"{name}.ext"
    ext_file.write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", pair.key,
             "-out", request, cwd=directory)  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request, "-CA", ca.cert, "-CAkey", ca.key, "-CAcreateserial",
        "-days", "2", "-out", pair.cert, "-extfile", ext_file,
        cwd=directory,
    )  # fmt: skip
    pair.key.chmod(0o644)  # the broker runs as us, but make sure Erlang can read it
    return pair


def make_pki(directory: Path) -> TestPki:
    """Create the certificates under ``directory`` (about a second with RSA 2048)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca(directory, "ca")
    rogue_ca = _ca(directory, "rogue-ca")
    server_ext = "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n"
    client_ext = "extendedKeyUsage=clientAuth\n"
    return TestPki(
        ca=ca,
        server=_signed(directory, "server", ca, extensions=server_ext),
        client=_signed(directory, "client", ca, extensions=client_ext),
        rogue_ca=rogue_ca,
        rogue_client=_signed(directory, "rogue-client", rogue_ca, extensions=client_ext),
    )


def tls_listener_conf(pki: TestPki, port: int) -> str:
    """``rabbitmq.conf`` lines for a TLS listener on 127.0.0.1 that requires a client certificate."""
    return "\n".join(
        [
            f"listeners.ssl.default = 127.0.0.1:{port}",
            f"ssl_options.cacertfile = {pki.ca.cert}",
            f"ssl_options.certfile = {pki.server.cert}",
            f"ssl_options.keyfile = {pki.server.key}",
            "ssl_options.verify = verify_peer",
            "ssl_options.fail_if_no_peer_cert = true",
            "",
        ]
    )
