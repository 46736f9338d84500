"""Who may take part in the checkpoint plane: the servers' proof of the token, and optional (mutual) TLS.

The pusher learns the servers' addresses from Redis, which it does not trust with its token or the
weights. Before either, it sends a fresh nonce (``Prove``); the server answers ``proof(token, nonce,
server_id, address)``. Only a holder of the checkpoint token can compute it, and it binds the address the
pusher dialled, so a fake server cannot relay the challenge to a real one at another address. An attacker
on the path to a real server's own address is what TLS (``checkpoint.tls_*``) is for. The stage port, which
carries a Stage's bytes outside gRPC, is TLS with the same files (``ssl_context``).
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from pathlib import Path
from typing import Any

import grpc

from core.config import CheckpointConfig

NONCE_BYTES = 32
_CONTEXT = b"rollwave checkpoint proof v1"


def proof(token: str, nonce: bytes, server_id: str, address: str) -> bytes:
    """HMAC-SHA256 under the checkpoint token of the nonce, the server's id and its gRPC address
    (each length-prefixed, so no two different triples share a message)."""
    parts = (_CONTEXT, nonce, server_id.encode(), address.encode())
    message = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def _tls_paths(cfg: CheckpointConfig) -> tuple[Path, Path, Path] | None:
    """(key, certificate, CA) files, or None when TLS is off (the config sets all three or none)."""
    if cfg.tls_key is None or cfg.tls_cert is None or cfg.tls_ca is None:
        return None
    return cfg.tls_key, cfg.tls_cert, cfg.tls_ca


def _tls_files(cfg: CheckpointConfig) -> tuple[bytes, bytes, bytes] | None:
    """(key, certificate, CA) as PEM bytes, or None when TLS is off."""
    paths = _tls_paths(cfg)
    return None if paths is None else (paths[0].read_bytes(), paths[1].read_bytes(), paths[2].read_bytes())


def server_credentials(cfg: CheckpointConfig) -> grpc.ServerCredentials | None:
    """The receiver's TLS credentials (clients must present a certificate signed by ``tls_ca``), or None
    for a plaintext port when ``checkpoint.tls_*`` are unset."""
    files = _tls_files(cfg)
    if files is None:
        return None
    key, cert, ca = files
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(cfg: CheckpointConfig) -> grpc.ChannelCredentials | None:
    """The pusher's TLS credentials (it presents its own certificate), or None for plaintext channels."""
    files = _tls_files(cfg)
    if files is None:
        return None
    key, cert, ca = files
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, cfg: CheckpointConfig,
                 options: list[tuple[str, Any]]) -> grpc.Channel:
    """A channel to a receiver: plaintext without ``credentials``; else TLS, where the server must present a
    certificate signed by ``tls_ca`` for the host dialled, or for ``tls_server_name`` when that is set."""
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    if cfg.tls_server_name is not None:
        options = [*options, ("grpc.ssl_target_name_override", cfg.tls_server_name)]
    return grpc.secure_channel(address, credentials, options=options)


def ssl_context(cfg: CheckpointConfig, server_side: bool) -> ssl.SSLContext | None:
    """The stage port's TLS, from the files the gRPC port uses, or None when ``checkpoint.tls_*`` are unset.

    Each side presents its certificate and requires the peer's, signed by ``tls_ca``; the pusher checks the
    receiver's for ``tls_server_name`` (or the host dialled, ``server_hostname``) as its gRPC channel does. The
    receiver needs no name from the pusher's: a connection is admitted by its Stage's ticket, which only the
    caller of that Stage (whose certificate the gRPC port checked) was given.
    """
    paths = _tls_paths(cfg)
    if paths is None:
        return None
    key, cert, ca = paths
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cafile=ca)
    context.verify_mode = ssl.CERT_REQUIRED
    if server_side:
        # No TLS 1.3 session tickets: the pusher only sends, and tickets left unread in its socket would turn its
        # close into a reset that drops the payload's last bytes in flight.
        context.num_tickets = 0
    return context
