"""A throw-away CA with a server and a client certificate (openssl CLI), for mutual-TLS tests."""

from __future__ import annotations

import pathlib
import subprocess


def _run(*args: str, cwd: pathlib.Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, cn: str, ext: str, ca: str, cwd: pathlib.Path) -> None:
    _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
         f"/CN={cn}", cwd=cwd)
    (cwd / f"{name}.ext").write_text(ext)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
         "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


def make_certs(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """ca.pem; server.pem/key for 127.0.0.1 and localhost; client.pem/key; rogue.pem/key from another CA."""
    for ca in ("ca", "rogue-ca"):
        _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
             "-days", "2", "-subj", f"/CN={ca}", cwd=folder)
    _signed("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            "ca", folder)
    _signed("client", "steploop-client", "extendedKeyUsage=clientAuth\n", "ca", folder)
    _signed("rogue", "rogue-client", "extendedKeyUsage=clientAuth\n", "rogue-ca", folder)
    return {p.stem if p.suffix == ".pem" else p.name: p for p in folder.iterdir()}
