"""A mutual TLS handshake on the checkpoint plane's terms, for checking the certificates a deployment makes."""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import grpc

from core.checkpoint_auth import channel_credentials, open_channel, server_credentials
from core.config import CheckpointConfig


def handshakes(receiver: CheckpointConfig, pusher: CheckpointConfig,
               credentials: grpc.ChannelCredentials | None = None, timeout_s: float = 30.0) -> bool:
    """Whether a pusher configured as ``pusher`` (its own credentials unless ``credentials`` is given) connects
    over TLS to a gRPC server on 127.0.0.1 with ``receiver``'s credentials: a client certificate signed by its
    CA is required, and the server's must be for 127.0.0.1 or ``pusher.tls_server_name``. A failed handshake
    is a channel in transient failure, seen at once; neither outcome within ``timeout_s`` is an error."""
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(receiver))
    server.start()
    channel = open_channel(f"127.0.0.1:{port}", credentials or channel_credentials(pusher), pusher, [])
    states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
    channel.subscribe(states.put, try_to_connect=True)
    try:
        while (state := states.get(timeout=timeout_s)) not in (grpc.ChannelConnectivity.READY,
                                                               grpc.ChannelConnectivity.TRANSIENT_FAILURE):
            continue
        return state == grpc.ChannelConnectivity.READY
    except queue.Empty:
        raise AssertionError(f"the TLS handshake with 127.0.0.1:{port}: neither done nor failed in {timeout_s} s"
                             ) from None
    finally:
        channel.unsubscribe(states.put)
        channel.close()
        server.stop(None)
