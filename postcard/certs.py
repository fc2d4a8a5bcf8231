"""Certificates and keys of a deployment: the TLS CA and server certificate, SuperNode keys.

* :func:`make_certificates` — a private CA and a server certificate for the SuperLink
  (its host names / IPs as SANs), written with the ``cryptography`` package;
* :func:`make_node_keys` — one EC (P-384) key pair per SuperNode in OpenSSH format, the
  format ``flower-supernode --auth-supernode-private-key`` and
  ``flwr supernode register`` expect;
* :func:`layout_secrets` — the same, sorted into one folder per holder (the CA, the
  SuperLink, the public material, each SuperNode), so that each machine or container gets
  only its own secrets (``docker/compose.yaml`` mounts one folder per service).

Private keys are written with mode 0600, also over an existing file (``fchmod``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

LOOPBACK = "127.0.0.1"
# file names inside a certificate folder (the same names the docker/ files use)
CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.pem", "server.key"


def make_certificates(folder: str | Path, hosts: list[str] | tuple[str, ...] = ("localhost", LOOPBACK),
                      days: int = 365) -> dict[str, Path]:
    """A private CA (``ca.crt``/``ca.key``) and a SuperLink certificate (``server.pem``/``server.key``).

    ``hosts`` are the names and IP addresses SuperNodes and the ``flwr`` CLI use to reach
    the SuperLink; each becomes a subjectAltName (TLS checks the address against them).
    Keys are unencrypted PEM, readable by the owner only. Returns the four paths.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ValueError("at least one host name or IP address is needed for the certificate")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)  # tolerate small clock skew
    until = now + dt.timedelta(days=int(days))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Postcard"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "Postcard federation CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Postcard"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, str(hosts[0]))]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    paths = {name: folder / name for name in (CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY)}
    _write(paths[CA_CERT], ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths[CA_KEY], key_pem(ca_key), private=True)
    _write(paths[SERVER_CERT], server_cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(paths[SERVER_KEY], key_pem(server_key), private=True)
    return paths


def make_node_keys(folder: str | Path, nodes: int, prefix: str = "supernode",
                   first: int = 0) -> list[tuple[Path, Path]]:
    """``nodes`` EC P-384 key pairs in OpenSSH format: ``<prefix>-<i>`` and ``<prefix>-<i>.pub``,
    ``i`` = ``first`` ... ``first + nodes - 1``.

    The private key stays on the SuperNode (``--auth-supernode-private-key``); the public
    key is registered on the SuperLink with ``flwr supernode register <key>.pub <connection>``.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(int(first), int(first) + int(nodes)):
        key = ec.generate_private_key(ec.SECP384R1())
        private = folder / f"{prefix}-{i}"
        public = folder / f"{prefix}-{i}.pub"
        _write(private, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()), private=True)
        _write(public, key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n", private=False)
        pairs.append((private, public))
    return pairs


def _write(path: Path, data: bytes, *, private: bool) -> None:
    """Write ``data`` with mode 0600 (``private``) or 0644, whatever mode an existing file had.

    ``O_CREAT``'s mode applies only to a file it creates: a key written over an existing
    0644 file would stay world-readable, so the mode is set on the open descriptor
    (``fchmod``) before a byte is written.
    """
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def layout_secrets(root: str | Path, nodes: int, hosts: list[str] | tuple[str, ...] = ("localhost", LOOPBACK),
                   days: int = 365) -> dict[str, Path]:
    """The secrets of a federation, one folder per holder; what exists already is kept.

    * ``ca/``: ``ca.crt``, ``ca.key`` — the CA; its key signs certificates and goes nowhere;
    * ``superlink/``: ``ca.crt``, ``server.pem``, ``server.key`` — the SuperLink's TLS;
    * ``public/``: ``ca.crt`` and every ``supernode-<i>.pub`` — public material (for the
      operator who registers the keys, and for anyone who connects);
    * ``supernode-<i>/``: ``ca.crt`` and ``supernode-<i>`` — SuperNode ``i``'s own private key.

    Returns {folder name: path}. Runs again without replacing a certificate or a key, so a
    key registered with the SuperLink stays valid.
    """
    root = Path(root)
    folders = {name: root / name for name in ("ca", "superlink", "public", *(f"supernode-{i}" for i in range(nodes)))}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    ca, link, public = folders["ca"], folders["superlink"], folders["public"]
    if not (ca / CA_KEY).exists():
        made = make_certificates(ca, hosts=hosts, days=days)
        for name in (SERVER_CERT, SERVER_KEY):  # the server's pair belongs to the SuperLink alone
            _copy(made[name], link / name, private=name == SERVER_KEY)
            made[name].unlink()
        _copy(ca / CA_CERT, link / CA_CERT, private=False)
    _copy(ca / CA_CERT, public / CA_CERT, private=False)
    for i in range(int(nodes)):
        own = folders[f"supernode-{i}"]
        if not (own / f"supernode-{i}").exists():
            (_, pub), = make_node_keys(own, 1, first=i)
            _copy(pub, public / pub.name, private=False)
            pub.unlink()
        _copy(ca / CA_CERT, own / CA_CERT, private=False)
    return folders


def _copy(source: Path, target: Path, *, private: bool) -> None:
    if source.resolve() != Path(target).resolve():
        _write(Path(target), Path(source).read_bytes(), private=private)
