"""Fake-worker process specs (ports, process groups and cleanup are in :mod:`pdctl.testing`); a self-signed
certificate for TLS tests."""

from __future__ import annotations

import datetime
import ipaddress
import sys
from pathlib import Path
from typing import Any

from pdctl.runtime.plan import ProcessSpec
from pdctl.testing import free_port

FAKE_WORKER = str(Path(__file__).with_name("fake_worker.py"))


def fake_spec(
    name: str, role: str = "prefill", *args: str, wave: int = 0, port: int | None = None, **kw: Any
) -> ProcessSpec:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    return ProcessSpec(
        name=name,
        role=role,  # type: ignore[arg-type]
        argv=(sys.executable, FAKE_WORKER, "--port", str(port), *args),
        env=kw.pop("env", {"PYTHONUNBUFFERED": "1"}),
        url=url,
        ready_url=f"{url}/health",
        wave=wave,
        ports=(port,),
        **kw,
    )


def self_signed_cert(folder: Path, days: int) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key in ``folder`` (PEM): valid for ``days`` from two days
    ago, or expired since ``-days`` days when ``days`` is negative."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(days=2) if days > 0 else now - datetime.timedelta(days=10)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_path, key_path
