"""TLS for NATS: a private CA and a server certificate signed by it, made with `cryptography`.

The CA's certificate is what clients trust (NATS_CA_FILE, and the `ca` of a rackctl context); its key
never leaves the folder. `make run TLS=1` and compose use these files (docs/security.md).

    python -m deploy.tls DIR [--host nats --host localhost]
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1", "nats")
VALID_DAYS = 365


@dataclass(frozen=True)
class Files:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca-key.pem"

    @property
    def cert(self) -> Path:
        return self.dir / "server.pem"

    @property
    def key(self) -> Path:
        return self.dir / "server-key.pem"

    def exist(self) -> bool:
        return all(p.exists() for p in (self.ca, self.cert, self.key))

    def server_conf(self) -> str:
        """The `tls` block of nats-server's config."""
        return f'tls {{\n  cert_file: "{self.cert}"\n  key_file: "{self.key}"\n  timeout: 2\n}}\n'


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rackplane"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common)])  # fmt: skip


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))  # fmt: skip


def make(dir: Path, hosts: tuple[str, ...] = DEFAULT_HOSTS) -> Files:
    """A CA and a server certificate for `hosts` (names or IP addresses), unless they exist already."""
    files = Files(dir)
    if files.exist():
        return files
    dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("rackplane NATS CA"))
        .issuer_name(_name("rackplane NATS CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(files.ca_key, ca_key)
    _write_key(files.key, key)
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return files


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.tls", description="Make NATS's CA and certificate."
    )
    parser.add_argument("dir", type=Path)
    parser.add_argument("--host", action="append", help=f"a name or address of the server {DEFAULT_HOSTS}")
    a = parser.parse_args()
    files = make(a.dir, tuple(a.host) if a.host else DEFAULT_HOSTS)
    print(f"CA {files.ca}; server certificate {files.cert}")


if __name__ == "__main__":
    main()
