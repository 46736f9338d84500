"""The checkpoint plane's private CA and the two certificates it signs, made once for a deployment.

docker-compose's ``checkpoint-tls`` job and ``rollwave up`` make them (``python -m core.checkpoint_pki DIR
SERVER_NAME``); Helm makes its own with sprig. In DIR, each readable by its owner only:
- ``ca.crt``: the CA every side trusts; its key is never written, so nothing can sign another certificate;
- ``receiver.crt``/``.key``: the rollout servers' (DNS name SERVER_NAME, which the pusher checks:
  ``checkpoint.tls_server_name``), for serving only;
- ``trainer.crt``/``.key``: the trainers' (DNS name ``rollwave-trainer``, which the receivers check:
  ``checkpoint.tls_client_name``), for dialling only, so a receiver's key cannot push weights to another receiver.
A DIR that has ``ca.crt`` is kept as it is (it is written last). ``--hand-out ROLE=TARGET`` copies ``ca.crt``
and that role's certificate and key into TARGET, a directory only that role's processes see (compose: a volume
each), so no rollout server holds the trainers' key, which the receivers' check of the client name alone cannot
tell from a trainer's.
"""

from __future__ import annotations

import argparse
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from core.config import TRAINER_CERT_NAME

RECEIVER_NAME = "rollwave-checkpoint-receiver"  # what compose, Helm and `rollwave up` give SERVER_NAME
ROLES = ("receiver", "trainer")
VALID_DAYS = 3650


@dataclass(frozen=True)
class CheckpointPki:
    """Where the files of one checkpoint PKI are."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, role: str) -> Path:
        return self.dir / f"{role}.crt"

    def key(self, role: str) -> Path:
        return self.dir / f"{role}.key"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             valid: tuple[datetime.datetime, datetime.datetime]) -> x509.CertificateBuilder:
    """What all three certificates share: ``key``'s, for ``subject``, issued by ``issuer``, valid over ``valid``."""
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1]))


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` readable by its owner only (a key must never exist with wider permissions)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def ensure_checkpoint_pki(directory: Path, server_name: str) -> tuple[CheckpointPki, bool]:
    """The PKI in ``directory``, made there unless its ``ca.crt`` exists; returns it and whether it was made."""
    pki = CheckpointPki(directory)
    if pki.ca.exists():
        return pki, False
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rollwave checkpoint CA")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key, valid)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    for role, name, usage in (("receiver", server_name, ExtendedKeyUsageOID.SERVER_AUTH),
                              ("trainer", TRAINER_CERT_NAME, ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            _builder(_name(name), ca_name, key, valid)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        _write(pki.key(role), key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
        _write(pki.cert(role), cert.public_bytes(serialization.Encoding.PEM))
    _write(pki.ca, ca_cert.public_bytes(serialization.Encoding.PEM))  # last: its presence means the set is complete
    return pki, True


def hand_out(pki: CheckpointPki, role: str, target: Path) -> CheckpointPki:
    """Copy ``ca.crt`` and ``role``'s certificate and key into ``target`` (owner-only, as made); returns it as a PKI
    whose other role's files are absent."""
    out = CheckpointPki(target)
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    for src, dst in ((pki.cert(role), out.cert(role)), (pki.key(role), out.key(role)), (pki.ca, out.ca)):
        _write(dst, src.read_bytes())  # ca.crt last, as when made
    for other in ROLES:
        if other != role:  # a target once shared by both roles keeps none of the other's files
            for stale in (out.cert(other), out.key(other)):
                stale.unlink(missing_ok=True)
    return out


def _hand_out_arg(value: str) -> tuple[str, Path]:
    role, sep, target = value.partition("=")
    if not sep or role not in ROLES or not target:
        raise argparse.ArgumentTypeError(f"{value!r}: want ROLE=DIR with ROLE one of {', '.join(ROLES)}")
    return role, Path(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("server_name", help="the DNS name in the receivers' certificate (checkpoint.tls_server_name)")
    parser.add_argument("--hand-out", type=_hand_out_arg, action="append", default=[], metavar="ROLE=DIR",
                        help="also copy ca.crt and ROLE's (receiver, trainer) certificate and key into DIR")
    args = parser.parse_args(argv)
    pki, made = ensure_checkpoint_pki(args.dir, args.server_name)
    if made:
        print(f"checkpoint-tls: made a CA and the receiver's ({args.server_name}) and trainer's certificates in "
              f"{pki.dir}")
    else:
        print(f"checkpoint-tls: {pki.ca} exists; keeping the certificates there")
    for role, target in args.hand_out:
        hand_out(pki, role, target)
        print(f"checkpoint-tls: the {role}'s certificate and key, with ca.crt, in {target}")


if __name__ == "__main__":
    main()
