"""The launcher's secrets: a throw-away CA with the server's and every client's certificate (mutual TLS by default),
the TLS flags and options handed to the server and the clients, and the operator token of the servers it starts."""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from typing import Any

STATUS_CLIENT = "launcher"


# The operator credential of the servers this launcher starts (GetStatus is operator-only): random per launcher
# process, handed to the server in its environment (FEDGUARD_OPERATOR_TOKEN), never on a command line, in the
# run dir or in a log.
OPERATOR_TOKEN = secrets.token_urlsafe(24)


def make_tls_dir(client_ids: list[str], directory: Path | None = None, days: int = 2,
                 server_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:
    """A CA, a server certificate for ``server_hosts`` and a certificate per client (plus the launcher's own,
    for its status view), in the layout ``--tls-dir`` reads. Keys are written 0600 in a 0700 directory."""
    from fedguard.certs import issue_client_cert, issue_server_cert, make_ca, write_ca, write_private, write_public

    d = directory or Path(tempfile.mkdtemp(prefix="fedguard-tls-"))
    ca = make_ca("fedguard launcher CA", days=days)
    write_ca(d, ca)
    server = issue_server_cert(ca, list(dict.fromkeys(server_hosts)), days=days)
    write_public(d / "server.pem", server.cert_pem)
    write_private(d / "server.key", server.key_pem)
    for cid in [*client_ids, STATUS_CLIENT]:
        c = issue_client_cert(ca, cid, days=days)
        write_public(d / "clients" / f"{cid}.pem", c.cert_pem)
        write_private(d / "clients" / f"{cid}.key", c.key_pem)
    return d


def server_tls_flags(tls_dir: Path | None) -> list[str]:
    if tls_dir is None:
        return ["--insecure"]
    return ["--tls-cert", str(tls_dir / "server.pem"), "--tls-key", str(tls_dir / "server.key"),
            "--client-ca", str(tls_dir / "ca.pem")]


def client_tls_options(tls_dir: Path | None, cid: str) -> dict[str, Any]:
    """ClientConfig fields of client ``cid`` (its certificate in ``tls_dir``), or plaintext without one."""
    if tls_dir is None:
        return {"insecure": True}
    return {"ca_cert": str(tls_dir / "ca.pem"), "cert": str(tls_dir / "clients" / f"{cid}.pem"),
            "key": str(tls_dir / "clients" / f"{cid}.key")}


def client_tls_flags(tls_dir: Path | None, cid: str) -> list[str]:
    return [item for k, v in client_tls_options(tls_dir, cid).items()
            for item in (f"--{k.replace('_', '-')}",) + (() if v is True else (str(v),))]
