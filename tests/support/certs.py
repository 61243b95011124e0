"""Certificates made in the tests (cryptography): a CA, a server certificate for 127.0.0.1,
a client certificate it signed, and a stranger signed by another CA."""

from __future__ import annotations

import datetime
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_cert(tmp_path, name, issuer=None, *, ca=False, server=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    signer_cert, signer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    cert = builder.sign(signer_key, hashes.SHA256())
    cert_path, key_path = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key, str(cert_path), str(key_path)


def make_pki(tmp_path) -> dict:
    """{"ca": path, "server"/"client"/"stranger": (cert path, key path)}."""
    ca = make_cert(tmp_path, "ca", ca=True)
    server = make_cert(tmp_path, "server", (ca[0], ca[1]), server=True)
    client = make_cert(tmp_path, "client", (ca[0], ca[1]))
    other_ca = make_cert(tmp_path, "other-ca", ca=True)
    stranger = make_cert(tmp_path, "stranger", (other_ca[0], other_ca[1]))
    return {"ca": ca[2], "server": server[2:], "client": client[2:], "stranger": stranger[2:]}
