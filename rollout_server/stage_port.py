"""The stage port: a Stage's bytes on a TCP connection of their own, one kernel copy per side.

A gRPC stream copies each message several times (the kernel's, the C core's slices, Python's ``bytes``) and
hands it between threads: on two cores that held a Stage to about half of raw loopback TCP, and a bare gRPC
stream alone to 0.43-0.62 of it (``bench/checkpoint.py``). Here the pusher sends the payload's bytes as they
are, and a thread of this server receives them straight into the staged file (``StagedFile``, which checks
offsets and digests as on the gRPC path).

No byte is taken before the connection presents the 32-byte ticket of a Stage call, which the pusher sent in
that call's manifest over the authenticated gRPC port. The TLS handshake (with ``checkpoint.tls_*``, the gRPC
port's files) and the ticket are read by the accepting thread for every connection at once, without a thread
or a waiting slot each, so connections that send nothing cannot crowd out a pusher: one that has not
presented a ticket within ``connect_timeout_s`` is closed. Only then may a connection wait for its Stage
(whose manifest may still be on its way): one whose ticket a Stage in progress holds at once, at most
``MAX_UNCLAIMED`` others, each until the same deadline. Every refusal is closed, logged and counted in
``rollwave_rollout_checkpoint_refused{reason}``: ``handshake_timeout`` (no handshake and ticket in time), ``tls``
(the handshake failed), ``ticket`` (a ticket no Stage holds, or none), ``busy`` (``MAX_UNCLAIMED`` waiting).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from core.checkpoint_format import DATA_RECEIVED, TICKET_BYTES, StagedFile, StageError
from core.net import listen_socket

log = logging.getLogger(__name__)
MAX_UNCLAIMED = 8  # connections at once that have not yet been matched to a Stage
ENDED_KEPT = 64  # tickets of Stages that ended, so a connection late for one is refused at once
RECV_BYTES = 1 << 20
ACCEPT_RETRY_S = 0.1  # after an accept that failed for want of resources (file descriptors)


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
                                               f"{staged.total} bytes", grpc.StatusCode.UNAVAILABLE)
                try:
                    staged.write(staged.received, buf[:n])
                except OSError as exc:  # the staging area's file system, not the connection
                    raise storage_error(exc, f"data from {peer}: the staged file takes no more after "
                                             f"{staged.received} of {staged.total} bytes") from exc
            conn.sendall(DATA_RECEIVED)
        except TimeoutError:
            self.done.set_exception(StageError("timeout", f"data from {peer}: {staged.received} of {staged.total} "
                                                          "bytes by the Stage's deadline",
                                               grpc.StatusCode.DEADLINE_EXCEEDED))
        except StageError as exc:
            self.done.set_exception(exc)
        except OSError as exc:
            why = "the Stage ended" if self.aborted else str(exc)
            self.done.set_exception(StageError("stream", f"data connection from {peer} broke after "
                                                         f"{staged.received} of {staged.total} bytes: {why}",
                                               grpc.StatusCode.UNAVAILABLE))
        else:
            self.done.set_result(staged.received)


def storage_error(exc: OSError, what: str) -> StageError:
    """The staging area's file system refused (full, a file size limit) or failed: not the stream's fault."""
    full = exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
    return StageError("storage", f"{what}: {exc.strerror or exc}",
                      grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL)


@dataclass
class _Arriving:
    """A connection the accepting thread reads the handshake and ticket of."""

    conn: socket.socket  # an ssl.SSLSocket with TLS
    peer: str
    deadline: float  # time.monotonic() by which its ticket must be in, and its Stage ready for it
    handshaken: bool
    ticket: bytearray = field(default_factory=bytearray)


class StagePort:
    """The listening socket and the Stages that expect data; accepts, handshakes and reads tickets in a thread
    (non-blocking, every connection at once), waits for a Stage and receives in one per connection (its socket
    reads and file writes release the GIL while the event loop serves the gRPC calls)."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, ticket_timeout_s: float,
                 refused: Counter, server_id: str):
        self._sock = listen_socket(host, port, "checkpoint stage port")
        self._sock.setblocking(False)
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
        self._arriving: dict[socket.socket, _Arriving] = {}
        self._threads: set[threading.Thread] = set()
        self._accepter = threading.Thread(target=self._accept, name="stage-port", daemon=True)
        self._accepter.start()

    @property
    def connections(self) -> int:
        """Connections open: handshaking, waiting to be matched to a Stage, or receiving."""
        with self._cond:
            return len(self._arriving) + len(self._threads)

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
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: the socket reads as ready
        self._accepter.join(5)
        self._sock.close()
        for thread in list(self._threads):
            thread.join(5)

    def _accept(self) -> None:
        """Accept, handshake and read tickets until ``close``; connections past their deadline are refused."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            while not self._closed:
                deadlines = [a.deadline for a in self._arriving.values()]
                wait = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
                for key, _ in selector.select(wait):
                    if key.data is None:
                        self._take_new(selector)
                    else:
                        self._advance(selector, key.data)
                now = time.monotonic()
                for arriving in [a for a in self._arriving.values() if a.deadline <= now]:
                    got = f"{len(arriving.ticket)} of {TICKET_BYTES} ticket bytes" if arriving.handshaken \
                        else "no TLS handshake"
                    self._drop(selector, arriving, "handshake_timeout",
                               f"{got} within {self._ticket_timeout_s:g} s (checkpoint.connect_timeout_s)")
            for arriving in list(self._arriving.values()):
                self._drop(selector, arriving)
                arriving.conn.close()

    def _take_new(self, selector: selectors.BaseSelector) -> None:
        try:
            conn, addr = self._sock.accept()
        except (BlockingIOError, ConnectionAbortedError):
            return
        except OSError as exc:  # out of file descriptors, say: the connection waits in the backlog meanwhile
            if not self._closed:
                log.warning("%s: stage port: accept failed (%s); trying again in %g s", self._server_id, exc,
                            ACCEPT_RETRY_S)
                time.sleep(ACCEPT_RETRY_S)
            return
        peer = f"{addr[0]}:{addr[1]}"
        conn.setblocking(False)
        if self._tls is not None:
            try:
                conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except OSError as exc:  # reset already, say
                self._refuse(conn, peer, "tls", f"TLS failed: {exc!r}")
                return
        arriving = _Arriving(conn, peer, time.monotonic() + self._ticket_timeout_s, handshaken=self._tls is None)
        with self._cond:
            self._arriving[conn] = arriving
        selector.register(conn, selectors.EVENT_READ, arriving)

    def _advance(self, selector: selectors.BaseSelector, arriving: _Arriving) -> None:
        """Go on with a connection's handshake and ticket as far as its bytes allow; admit it once it has both."""
        conn = arriving.conn
        try:
            if isinstance(conn, ssl.SSLSocket) and not arriving.handshaken:
                conn.do_handshake()
                arriving.handshaken = True
            while len(arriving.ticket) < TICKET_BYTES:
                piece = conn.recv(TICKET_BYTES - len(arriving.ticket))
                if not piece:
                    self._drop(selector, arriving, "ticket", f"closed after {len(arriving.ticket)} of "
                                                             f"{TICKET_BYTES} ticket bytes")
                    return
                arriving.ticket += piece
        except (ssl.SSLWantReadError, BlockingIOError):
            selector.modify(conn, selectors.EVENT_READ, arriving)
            return
        except ssl.SSLWantWriteError:
            selector.modify(conn, selectors.EVENT_WRITE, arriving)
            return
        except OSError as exc:
            tls = isinstance(exc, ssl.SSLError) or not arriving.handshaken
            self._drop(selector, arriving, "tls" if tls else "ticket",
                       f"{'TLS handshake' if tls else 'reading the ticket'} failed: {exc!r}")
            return
        self._drop(selector, arriving)
        self._admit(arriving)

    def _drop(self, selector: selectors.BaseSelector, arriving: _Arriving, reason: str = "", why: str = "") -> None:
        """The accepting thread is done with the connection; with ``reason``, it is refused."""
        selector.unregister(arriving.conn)
        with self._cond:
            del self._arriving[arriving.conn]
        if reason:
            self._refuse(arriving.conn, arriving.peer, reason, why)

    def _admit(self, arriving: _Arriving) -> None:
        """A connection with its ticket waits for that Stage in a thread of its own: at once when a Stage in
        progress holds the ticket, else (its manifest may still be on its way) in one of ``MAX_UNCLAIMED`` slots."""
        conn, ticket = arriving.conn, bytes(arriving.ticket)
        conn.setblocking(True)
        with self._cond:
            slotted = ticket not in self._expected
        if slotted and not self._unclaimed.acquire(blocking=False):
            self._refuse(conn, arriving.peer, "busy", f"a ticket no Stage holds yet, and {MAX_UNCLAIMED} "
                                                      "connections wait for theirs")
            return
        thread = threading.Thread(target=self._serve, args=(conn, arriving.peer, ticket, arriving.deadline,
                                                              slotted), name="stage-data", daemon=True)
        with self._cond:
            if self._closed:
                if slotted:
                    self._unclaimed.release()
                conn.close()
                return
            self._threads.add(thread)
        thread.start()

    def _serve(self, conn: socket.socket, peer: str, ticket: bytes, deadline: float, slotted: bool) -> None:
        try:
            try:
                incoming = self._claim(conn, peer, ticket, deadline)
            finally:
                if slotted:
                    self._unclaimed.release()
            if incoming is not None:
                with conn:
                    incoming.receive(conn, peer)
        finally:
            with self._cond:
                self._threads.discard(threading.current_thread())

    def _claim(self, conn: socket.socket, peer: str, ticket: bytes, deadline: float) -> IncomingData | None:
        """The Stage whose ticket the connection presented, once its file is open; None (refused) otherwise."""
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
            self._refuse(conn, peer, "ticket", why)
            return None
        return incoming

    def _refuse(self, conn: socket.socket, peer: str, reason: str, why: str) -> None:
        self._refused.labels(reason).inc()
        log.warning("%s: stage port connection from %s refused (%s): %s", self._server_id, peer, reason, why)
        conn.close()
