"""The stage port: a Stage's bytes on a TCP connection of their own, one kernel copy per side.

A gRPC stream copies each message several times (the kernel's, the C core's slices, Python's ``bytes``) and
hands it between threads: on two cores that held a Stage to about half of raw loopback TCP, and a bare gRPC
stream alone to 0.43-0.62 of it (``bench/checkpoint.py``). Here the pusher sends the payload's bytes as they
are, and a thread of this server receives them straight into the staged file (``StagedFile``, which checks
offsets and digests as on the gRPC path).

No byte is taken before the connection presents the 32-byte ticket of a Stage call, which the pusher sent in
that call's manifest over the authenticated gRPC port. A connection that presents none within
``connect_timeout_s``, or a ticket no Stage holds, is closed, logged and counted
(``rollwave_rollout_checkpoint_refused{reason="ticket"}``); at most ``MAX_UNCLAIMED`` connections wait for a
ticket at once. With ``checkpoint.tls_*`` the port is TLS, with the gRPC port's files.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections import deque
from concurrent.futures import Future

from prometheus_client import Counter

from core.checkpoint_format import DATA_RECEIVED, TICKET_BYTES, StagedFile, StageError
from core.net import listen_socket

log = logging.getLogger(__name__)
MAX_UNCLAIMED = 8  # connections at once that have not yet been matched to a Stage
ENDED_KEPT = 64  # tickets of Stages that ended, so a connection late for one is refused at once
RECV_BYTES = 1 << 20


class IncomingData:
    """One Stage's data connection: expected from the manifest on, open once its file is ready, done (the byte
    count, or the StageError) when every byte arrived or the transfer failed."""

    def __init__(self, deadline: float):
        self.deadline = deadline  # time.monotonic() by which every byte must be in
        self.done: Future[int] = Future()
        self.staged: StagedFile | None = None
        self.aborted = False
        self.peer = ""  # the connection's address, once one presented the ticket
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()

    def abort(self) -> None:
        """The Stage ended: a connection not yet taken is refused; one receiving is cut (its thread then
        settles ``done``; wait for that before closing the file)."""
        with self._lock:
            self.aborted = True
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        elif not self.done.done():
            self.done.set_exception(StageError("stream", "the Stage ended before its data connection"))

    def _take(self, conn: socket.socket, peer: str) -> bool:
        with self._lock:
            if self.aborted or self._conn is not None:
                return False
            self._conn, self.peer = conn, peer
            return True

    def receive(self, conn: socket.socket, peer: str) -> None:
        """Read the payload into the staged file and say so to the pusher; settle ``done``."""
        staged = self.staged
        assert staged is not None
        buf = memoryview(bytearray(RECV_BYTES))
        try:
            while staged.received < staged.total:
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                conn.settimeout(remaining)
                n = conn.recv_into(buf, min(RECV_BYTES, staged.total - staged.received))
                if n == 0:
                    raise StageError("stream", f"data connection from {peer} closed after {staged.received} of "
                                               f"{staged.total} bytes")
                staged.write(staged.received, buf[:n])
            conn.sendall(DATA_RECEIVED)
        except TimeoutError:
            self.done.set_exception(StageError("timeout", f"data from {peer}: {staged.received} of {staged.total} "
                                                          "bytes by the Stage's deadline"))
        except StageError as exc:
            self.done.set_exception(exc)
        except OSError as exc:
            why = "the Stage ended" if self.aborted else str(exc)
            self.done.set_exception(StageError("stream", f"data connection from {peer} broke after "
                                                         f"{staged.received} of {staged.total} bytes: {why}"))
        else:
            self.done.set_result(staged.received)


class StagePort:
    """The listening socket and the Stages that expect data; accepts in a thread, receives in one per
    connection (its socket reads and file writes release the GIL while the event loop serves the gRPC calls)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, ticket_timeout_s: float,
                 refused: Counter, server_id: str):
        self._sock = listen_socket(host, port, "checkpoint stage port")
        self.port: int = self._sock.getsockname()[1]
        self._tls = tls
        self._ticket_timeout_s = ticket_timeout_s
        self._refused = refused
        self._server_id = server_id
        self._expected: dict[bytes, IncomingData] = {}
        self._ended: deque[bytes] = deque(maxlen=ENDED_KEPT)
        self._cond = threading.Condition()
        self._unclaimed = threading.BoundedSemaphore(MAX_UNCLAIMED)
        self._closed = False
        self._threads: set[threading.Thread] = set()
        self._accepter = threading.Thread(target=self._accept, name="stage-port", daemon=True)
        self._accepter.start()

    @property
    def connections(self) -> int:
        """Connections open: receiving, or waiting to be matched to a Stage."""
        with self._cond:
            return len(self._threads)

    def expect(self, ticket: bytes, deadline: float) -> IncomingData:
        """Register a Stage's ticket (its manifest's); ``forget`` it when the Stage ends, whatever the outcome."""
        if len(ticket) != TICKET_BYTES:
            raise StageError("manifest", f"data_ticket has {len(ticket)} bytes, not {TICKET_BYTES}")
        incoming = IncomingData(deadline)
        with self._cond:
            if ticket in self._expected:
                raise StageError("manifest", "data_ticket already used by a Stage in progress")
            self._expected[ticket] = incoming
            self._cond.notify_all()
        return incoming

    def ready(self, incoming: IncomingData, staged: StagedFile) -> None:
        """The staged file is open: the connection may write into it."""
        with self._cond:
            incoming.staged = staged
            self._cond.notify_all()

    def forget(self, ticket: bytes) -> None:
        with self._cond:
            incoming = self._expected.pop(ticket, None)
            if incoming is not None:
                self._ended.append(ticket)
            self._cond.notify_all()
        if incoming is not None:
            incoming.abort()

    def close(self) -> None:
        """Stop accepting, cut the connections still open and wait for their threads."""
        with self._cond:
            self._closed = True
            expected = list(self._expected.values())
            self._cond.notify_all()
        for incoming in expected:
            incoming.abort()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._sock.close()
        self._accepter.join(5)
        for thread in list(self._threads):
            thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            peer = f"{addr[0]}:{addr[1]}"
            if not self._unclaimed.acquire(blocking=False):
                self._refuse(conn, peer, f"more than {MAX_UNCLAIMED} connections waiting for a Stage")
                continue
            thread = threading.Thread(target=self._serve, args=(conn, peer), name="stage-data", daemon=True)
            with self._cond:
                if self._closed:
                    self._unclaimed.release()
                    conn.close()
                    return
                self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        try:
            claimed = self._claim(conn, peer)
            if claimed is not None:
                incoming, conn = claimed
                with conn:
                    incoming.receive(conn, peer)
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())

    def _claim(self, conn: socket.socket, peer: str) -> tuple[IncomingData, socket.socket] | None:
        """The Stage whose ticket the connection presents, once its file is open, and the connection (TLS
        wrapped, with TLS); None (refused) otherwise."""
        deadline = time.monotonic() + self._ticket_timeout_s
        try:
            try:
                conn.settimeout(self._ticket_timeout_s)
                if self._tls is not None:
                    conn = self._tls.wrap_socket(conn, server_side=True)
                ticket = _read_exactly(conn, TICKET_BYTES, deadline)
            except (OSError, EOFError) as exc:
                self._refuse(conn, peer, f"no ticket within {self._ticket_timeout_s:g} s ({exc!r})")
                return None
            with self._cond:
                while True:
                    incoming = self._expected.get(ticket)
                    if self._closed or ticket in self._ended or \
                            (incoming is not None and (incoming.aborted or incoming.staged is not None)):
                        break
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
            if incoming is None or incoming.staged is None or not incoming._take(conn, peer):
                why = "the Stage it names ended" if incoming is not None or ticket in self._ended \
                    else "a ticket no Stage holds"
                self._refuse(conn, peer, why)
                return None
            return incoming, conn
        finally:
            self._unclaimed.release()

    def _refuse(self, conn: socket.socket, peer: str, why: str) -> None:
        self._refused.labels("ticket").inc()
        log.warning("%s: stage port connection from %s refused: %s", self._server_id, peer, why)
        conn.close()


def _read_exactly(conn: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        conn.settimeout(max(deadline - time.monotonic(), 1e-3))
        piece = conn.recv(n - len(out))
        if not piece:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += piece
    return bytes(out)
