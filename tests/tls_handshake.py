"""A mutual TLS handshake on the checkpoint plane's terms, for checking the certificates a deployment makes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from core.checkpoint_auth import channel_credentials, open_channel, server_credentials
from core.config import CheckpointConfig


def handshakes(receiver: CheckpointConfig, pusher: CheckpointConfig,
               credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 5.0) -> bool:
    """Whether a pusher configured as ``pusher`` (its own credentials unless ``credentials`` is given) connects
    over TLS to a gRPC server on 127.0.0.1 with ``receiver``'s credentials: a client certificate signed by its
    CA is required, and the server's must be for 127.0.0.1 or ``pusher.tls_server_name``."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(receiver))
    server.start()
    channel = open_channel(f"127.0.0.1:{port}", credentials or channel_credentials(pusher), pusher, [])
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()
        server.stop(None)
