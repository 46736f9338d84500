"""Checkpoint pusher: each new policy version goes to every live rollout server in the background.

``push_model`` is the only part on the training step's path: every rank takes part in the per-parameter
all-gathers, and rank 0 copies the gathered tensors into a host snapshot (``trainer.snapshot``). From there
one thread per server streams it (Stage), then commits it, each call with its own deadline: connect
(``connect_timeout_s``), Stage (``stage_timeout_s`` + bytes / ``min_throughput_mib_s``) and Commit
(``commit_timeout_s``). A frozen or slow server therefore costs the trainer nothing; it misses versions.
With ``checkpoint.stage_transport: tcp`` (the default) a Stage's bytes go on the server's stage port
(``rollout_server.stage_port``), admitted by a ticket the Stage call carries; its stream then carries only the
manifest and the trailer.

A version is published (``StalenessControl.set_version``: ``rw:<run>:version`` and the groups its weights were
trained on, which admission reads) once ``quorum`` of the
servers live at that moment committed it: checked at each commit, and again by the watcher as the live set
changes (a frozen server that leaves it no longer holds the newest version back). A server that missed
versions gets only the newest on its next push, never the ones between: a server's thread keeps one pending
snapshot, and a newer one replaces it. The watcher re-offers the newest version to every live server that
does not serve it yet (a restarted server, or a straggler after its back-off), so a server that comes back
catches up without waiting for the next training step. A server's heartbeat lags a commit, so what a server
committed counts as served until it heartbeats it, but only while the server runs the same incarnation (its
registration's ``started``): one that restarted under the same id and address, back on its base weights within
the registry's TTL, is caught up again, unless the newest snapshot was cast for the servers live when it was taken to
a dtype this one does not serve (restarted in fp32 where it served bf16): it then waits for the next version, which is
taken in its precision, rather than load rounded weights (stage ``stage``, reason ``cast``, once per incarnation): an
error names it, and ``rollwave_trainer_push_stranded_servers`` counts it until a version reaches it. The trainer sees
to that while it waits for data (``repush_due``): with no step trained since the newest version (its masters are still
that version's) it pushes that version once more in its precision to the stranded servers alone (``repush_model``, from
a one-off buffer freed once sent); with steps trained since (``buffer.push_every`` above 1) it pushes its present
weights as a new version, ahead of schedule, which is taken in the trainer's precision for the mixed fleet. No second
full copy of a version is kept for this. A fleet that restarted so used to stay on its base weights, its groups too
stale to train, until the next scheduled push, which a trainer waiting for data may never reach. A server listed by
address alone has no ``started``: while it has nothing to be sent, the watcher asks its Status, and one that serves
less than it committed restarted, and is caught up.

Before its token or any weights, the pusher asks each server to prove it holds the checkpoint token
(``Prove``, see ``core.checkpoint_auth``): a server registered in Redis that cannot gets nothing, and the
refusal is a failure at stage ``prove`` (reason ``unproven``). With ``checkpoint.tls_*`` the channels are
mutual TLS.

A LoRA model's push carries its adapter alone (``trainer.lora``), and its commit counts only when the engine
reports serving an adapter with the checksum of the bytes pushed (else stage ``verify``, reason ``mismatch``).

A trainer's pusher asks before each Commit whether a newer trainer of the run started (``fence``:
``ReplayBuffer.check_fence``, one round trip): the commit is the moment a server starts serving a version, and
the newer trainer's versions are numbered from what the servers serve, so one committed after it started would
serve the older trainer's weights under a number the newer one counts as its own. A refused push fails at stage
``fence`` (reason ``fenced``; ``unavailable`` when Redis cannot tell, and nothing is committed), the watcher offers
nothing more, and ``flush`` raises the refusal (``TrainerFenced``), so the trainer stops rather than recording an
end that belongs to the newer one. What a push writes in Redis afterwards is refused the same way when the trainer's
``staleness`` and ``record`` are fenced (``RunRecord``): a version a quorum committed before the newer trainer
started, published after it did, used to replace the newer trainer's version (or the groups it was trained on), and
a push that failed after it started replaced the newer trainer's record of that server.

Every failed push is logged naming the server and the stage, counted in
``rollwave_trainer_push_failures_total{stage,reason}`` (no server label: ids are hostname-pid by default, a new
series at every restart) and recorded (``record``, the registry's per-server push results that
``rollwave status``, the API and the dashboard show). A version that no quorum
committed is an error in the log, listing each server's reason.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import secrets
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import redis
import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry, Counter, Gauge

from buffer.registry import PushRecord, ServerRegistry
from buffer.replay import TrainerFenced
from buffer.staleness import StalenessControl
from core.checkpoint_auth import NONCE_BYTES, channel_credentials, open_channel, proof, ssl_context
from core.checkpoint_format import DATA_RECEIVED, DTYPES, GRPC_OPTIONS, REASON_KEY, SERVICE, TICKET_BYTES
from core.config import CheckpointConfig
from proto import checkpoint_pb2 as pb
from proto import checkpoint_pb2_grpc as pb_grpc
from trainer.lora import adapter_config_json, adapter_metas, is_lora, iter_adapter_params
from trainer.parallel import iter_full_params
from trainer.snapshot import BufferPool, Snapshot, TensorMeta, cast_metas, model_metas, take_snapshot, trailer_chunk

log = logging.getLogger(__name__)
_STAGE_METHOD = f"/{SERVICE}/Stage"
WATCH_S = 1.0  # how often the watcher lists the live servers and re-offers the newest version
BACKOFF_S = (1.0, 30.0)  # a server's back-off after a failed push: first, longest (doubling)
RETRY_PAUSE_S = (0.2, 5.0)  # the pause before a Stage's or a Commit's next try: first, longest (doubling)
NOT_CONNECTED_PROBE_S = 1.0  # the call that asks a channel that never came up why
TLS_WORDS = ("handshake", "verification", "certificate")  # in gRPC's reason: the connection failed on TLS
REFUSAL_WAIT_S = 1.0  # after the stage port failed, how long to wait for the Stage call to say why
# Failures that another try of the same version cannot fix: the server refused it, or it timed out
# (a straggler waits for its back-off and then gets the newest version instead).
_FINAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED,
          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_REASONS = {grpc.StatusCode.DEADLINE_EXCEEDED: "timeout", grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.UNAUTHENTICATED: "unauthenticated", grpc.StatusCode.PERMISSION_DENIED: "unauthenticated",
            grpc.StatusCode.INVALID_ARGUMENT: "rejected", grpc.StatusCode.FAILED_PRECONDITION: "rejected",
            grpc.StatusCode.DATA_LOSS: "checksum"}


@dataclass(frozen=True)
class Target:
    """A rollout server to push to, and the version it reports serving (registry heartbeat). A server
    listed by address alone (``named`` False) proves the token under whatever id it gives. ``started`` tells
    its incarnation (the registry's time of its registration): a restart changes it."""

    server_id: str
    address: str
    version: int = 0
    named: bool = True
    started: float = 0.0


@dataclass
class PushResult:
    """One version on one server: committed, failed (at ``stage``: connect, prove, stage, fence, commit, verify) or
    skipped because a newer version replaced it before its turn."""

    server_id: str
    address: str
    version: int
    ok: bool = False
    skipped: bool = False
    stage: str = ""
    reason: str = ""
    error: str = ""
    serves: int = 0
    bytes: int = 0
    stage_seconds: float = 0.0
    pause_seconds: float = 0.0
    load_seconds: float = 0.0
    stage_attempts: int = 0
    commit_attempts: int = 0
    finished: float = 0.0

    def record(self) -> PushRecord:
        return PushRecord(version=self.version, ok=self.ok, stage=self.stage, reason=self.reason, error=self.error,
                          serves=self.serves, at=self.finished)


class PushRound:
    """One version's fan-out to the servers that were live when it was taken; ``wait()`` for all of them."""

    def __init__(self, version: int, targets: Sequence[Target], snapshot_seconds: float, trained: int = 0):
        self.version = version
        self.trained = trained  # groups of the run the weights were trained on, published with the version
        self.targets = list(targets)
        self.snapshot_seconds = snapshot_seconds
        self.results: dict[str, PushResult] = {}
        self.committed: set[str] = set()  # ids of the servers that committed it, catch-ups included
        self.published = False
        self.reported = False
        self._done = threading.Event()
        if not self.targets:
            self._done.set()

    @property
    def servers(self) -> list[PushResult]:
        return [self.results[t.server_id] for t in self.targets if t.server_id in self.results]

    @property
    def ok(self) -> bool:
        return self.final and bool(self.targets) and all(s.ok for s in self.servers)

    @property
    def final(self) -> bool:
        return self._done.is_set()

    @property
    def commits(self) -> int:
        """Servers that committed the version: one that commits it again (caught up after a restart) counts once."""
        return len(self.committed)

    def add(self, result: PushResult) -> None:
        if result.ok:
            self.committed.add(result.server_id)
        if any(t.server_id == result.server_id for t in self.targets):
            self.results.setdefault(result.server_id, result)
            if len(self.results) == len(self.targets):
                self._done.set()

    def wait(self, timeout_s: float | None = None) -> PushRound:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"push of version {self.version}: servers still pending after {timeout_s} s")
        return self


class PushMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter("rollwave_trainer_push_failures", "failed pushes of a version to a server (which "
                                "server: the log and the registry's push results)", ["stage", "reason"],
                                registry=self.registry)
        self.unpublished = Counter("rollwave_trainer_push_unpublished", "versions that no quorum committed",
                                   registry=self.registry)
        self.stranded = Gauge("rollwave_trainer_push_stranded_servers", "live servers that lack the newest version "
                              "and that the trainer cannot send it (reason cast: kept only cast to a dtype they do not "
                              "serve), until a version reaches them: a newer one, or the newest pushed again in the "
                              "trainer's precision (which servers: the log's error and the registry's push results)",
                              ["reason"], registry=self.registry)


def _pushes(params: Iterator[tuple[str, torch.Tensor | None]]) -> bool:
    """Whether this rank pushes (rank 0, or the only process); another only takes part in the all-gathers that
    ``params`` runs (drained here), every rank in step."""
    if dist.is_initialized() and dist.get_rank() != 0:
        for _ in params:
            pass
        return False
    return True


class _Failed(Exception):
    def __init__(self, stage: str, reason: str, error: str):
        super().__init__(error)
        self.stage, self.reason = stage, reason


def _failure(stage: str, exc: grpc.RpcError, deadline_s: float) -> _Failed:
    """The failure of one call: the receiver's own reason when it refused (a pause it timed out on
    included), else a timeout of our deadline or the gRPC code."""
    code = exc.code()
    reason = dict(exc.trailing_metadata() or ()).get(REASON_KEY)
    if reason is None and code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return _Failed(stage, "timeout", f"{stage}: no answer within its {deadline_s:.3g} s deadline")
    return _Failed(stage, str(reason or _REASONS.get(code, "failed")), f"{stage}: {code.name}: {exc.details()}")


class _Link:
    """The pushes to one server, in a thread of its own: at most one in flight and one pending."""

    def __init__(self, target: Target, pusher: CheckpointPusher):
        self.target = target
        self.committed = 0
        self.committed_to = target.started  # the incarnation that committed ``committed``
        self.retry_at = 0.0
        # from this server's last Status: the incarnation (``Target.started``) that answered, its dtypes by tensor name
        self._dtypes: tuple[float, dict[str, torch.dtype]] | None = None
        self._sent: Snapshot | None = None  # the last snapshot this link began to stage
        self._backoff = BACKOFF_S[0]
        self._pusher = pusher
        self._config = pusher.config
        self._pending: Snapshot | None = None
        self._busy = False
        self._probe = False  # a Status is asked for (``probe``)
        self._closed = False
        self._cond = threading.Condition()
        self._channel = open_channel(target.address, pusher.channel_credentials, self._config, GRPC_OPTIONS)
        self._stage = self._channel.stream_unary(_STAGE_METHOD, request_serializer=None,
                                                 response_deserializer=pb.StageReply.FromString)
        self._stub = pb_grpc.CheckpointEngineStub(self._channel)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"push-{target.server_id}")
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._busy and self._pending is None

    def offer(self, snapshot: Snapshot) -> None:
        """Push ``snapshot`` next; one still pending is skipped (only the newest version is worth sending)."""
        with self._cond:
            replaced, self._pending = self._pending, snapshot.acquire()
            self._cond.notify()
        if replaced is not None:
            self._pusher._finish(self._result(replaced.version, skipped=True))
            replaced.release()

    def probe(self) -> None:
        """Ask the server's Status (in this link's thread, unless a push is due) to learn of a restart that no
        registry tells: a server listed by address alone has no ``started``."""
        with self._cond:
            self._probe = True
            self._cond.notify()

    def close(self) -> None:
        """Stop (``join()`` waits for the thread): the channel's close cancels a call in flight."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, None
            self._cond.notify()
        if pending is not None:  # its round still hears from this server
            self._pusher._finish(self._result(pending.version, skipped=True))
            pending.release()
        self._pusher._strand(self.target.server_id, False)  # it left, or another server listens there
        self._channel.close()

    def join(self) -> None:
        self._thread.join()

    def serves(self, target: Target) -> int:
        """The version ``target`` serves at least: what it heartbeats, or what it committed through this link if it
        has not heartbeated that yet; a server that restarted since serves only what it says."""
        return max(target.version, self.committed if self.committed_to == target.started else 0)

    def dtypes_of(self, target: Target) -> dict[str, torch.dtype] | None:
        """The dtypes ``target`` serves, if this link read them from that very incarnation: a server restarted under
        its id and address (a new ``started``) may serve others, e.g. bf16 where it served fp32."""
        read = self._dtypes
        if read is None or self.target.server_id != target.server_id or read[0] != target.started:
            return None
        return read[1]

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._probe and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                snapshot, self._pending, self._probe = self._pending, None, False
                self._busy = snapshot is not None
            if snapshot is None:
                self._check_restart()
                continue
            started = self.target.started
            try:
                result = self._push(snapshot, started)
            finally:
                snapshot.release()
            self._settle(result, started)
            self._pusher._finish(result)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _settle(self, result: PushResult, started: float) -> None:
        """``started``: the incarnation the push went to, as known when it began (a restart the registry had not
        shown yet is credited to the old one, so the watcher offers the version once more: Status says it serves)."""
        if result.ok:
            self.committed, self.committed_to = result.version, started
            self._backoff, self.retry_at = BACKOFF_S[0], 0.0
        else:
            self.retry_at = time.monotonic() + self._backoff
            self._backoff = min(2 * self._backoff, BACKOFF_S[1])

    def _check_restart(self) -> None:
        """From the server's Status: a server that serves less than it committed through this link restarted (back on
        its base weights), so the watcher catches it up, and that push reads its dtypes (and says so if the newest
        snapshot is cast to others); else the dtypes it serves now are its present incarnation's. A server that does
        not answer is left to the next push, which reports why."""
        try:
            status = self._connect()
            dtypes = _status_dtypes(status)
        except _Failed as failed:
            log.debug("server %s (%s): no Status: %s", self.target.server_id, self.target.address, failed)
            return
        if status.current_version < self.committed:
            log.warning("server %s (%s) serves version %d where it committed %d: it restarted; catching it up",
                        self.target.server_id, self.target.address, status.current_version, self.committed)
            self.committed, self._sent, self._dtypes = status.current_version, None, None
        else:
            self._dtypes = (self.target.started, dtypes)

    def _result(self, version: int, **kw: object) -> PushResult:
        return PushResult(self.target.server_id, self.target.address, version, serves=self.target.version,
                          finished=time.time(), **kw)  # type: ignore[arg-type]

    def _newer_pending(self) -> bool:
        with self._cond:
            return self._pending is not None or self._closed

    def _push(self, snapshot: Snapshot, started: float) -> PushResult:
        """``started``: the incarnation the push goes to, as known when it began (its Status's dtypes are its)."""
        result = self._result(snapshot.version)
        try:
            status = self._connect()
            result.serves = status.current_version
            # Served already: a Commit of this very snapshot that outlived its deadline landed, or an adapter, which is
            # verified by its checksum. Full weights of another snapshot under that version (pushed again) are staged,
            # and refused: the weights the server serves under it are not known to be these.
            served = snapshot is self._sent or bool(snapshot.adapter_checksum)
            if result.serves != snapshot.version or not served:
                dtypes = _status_dtypes(status)
                self._dtypes = (started, dtypes)
                if rounded := self._pusher.rounded_for(snapshot, dtypes):
                    raise _Failed("stage", "cast", f"stage: version {snapshot.version} holds {rounded}, cast for the "
                                                   "servers live when it was taken; sent nothing: this server gets "
                                                   "the next version, taken in its precision")
                self._sent = snapshot
                self._stage_version(snapshot, dtypes, status.stage_port, result)
                self._commit(snapshot, result)
            elif snapshot.adapter_checksum:
                self._verify(snapshot, status.adapter_checksum)
        except _Failed as failed:
            result.stage, result.reason = failed.stage, failed.reason
            result.error = f"server {self.target.server_id} ({self.target.address}): {failed}"
        else:
            result.ok, result.serves = True, snapshot.version
        result.finished = time.time()
        return result

    def _connect(self) -> pb.StatusReply:
        """The server's Status (the version and the tensor dtypes it serves), asked once the channel is up and
        the server proved it holds the token: a server that cannot be reached, or is reached but does not
        answer (frozen), fails here within ``connect_timeout_s``."""
        timeout = self._config.connect_timeout_s
        self._prove(timeout)
        try:
            status = self._stub.Status(pb.StatusRequest(), metadata=self._pusher.metadata, timeout=timeout,
                                       wait_for_ready=True)
        except grpc.RpcError as exc:
            raise _failure("connect", exc, timeout) from None
        return status

    def _prove(self, timeout: float) -> None:
        """Challenge the server before sending it anything secret: it must answer with the HMAC of a fresh
        nonce, its id and the address dialled, under the checkpoint token."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            reply = self._stub.Prove(pb.ProveRequest(nonce=nonce), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and (why := self._not_connected(nonce)):
                reason = "tls" if any(word in why.lower() for word in TLS_WORDS) else "unavailable"
                raise _Failed("connect", reason, f"connect: not connected within its {timeout:.3g} s deadline: "
                                                 f"{why}") from None
            raise _failure("connect", exc, timeout) from None  # not reached, or frozen: nothing proven wrong
        target = self.target
        if target.named and reply.server_id != target.server_id:
            raise _Failed("prove", "unproven", f"prove: the server at this address says it is {reply.server_id!r}, "
                                               "not the registered one; sent it no token and no weights")
        expected = proof(self._pusher.token, nonce, reply.server_id, target.address)
        if not hmac.compare_digest(reply.proof, expected):
            raise _Failed("prove", "unproven", "prove: the server could not prove it holds the checkpoint token; "
                                               "sent it no token and no weights")

    def _not_connected(self, nonce: bytes) -> str | None:
        """Why the channel is down (the port refused, the TLS handshake failed: a certificate), from one more
        challenge that does not wait for it to come up; None when it is up (the server is there but does not
        answer)."""
        try:
            self._stub.Prove(pb.ProveRequest(nonce=nonce), timeout=NOT_CONNECTED_PROBE_S, wait_for_ready=False)
        except grpc.RpcError as exc:
            return exc.details() if exc.code() == grpc.StatusCode.UNAVAILABLE else None
        return None

    def _stage_version(self, snapshot: Snapshot, dtypes: dict[str, torch.dtype], stage_port: int,
                       result: PushResult) -> None:
        cfg = self._config
        deadline = cfg.stage_timeout_s + snapshot.nbytes / (cfg.min_throughput_mib_s * 2**20)
        over_port = cfg.stage_transport == "tcp" and stage_port != 0
        for attempt in range(cfg.retries + 1):
            result.stage_attempts += 1
            try:
                if over_port:
                    reply = self._stage_over_port(snapshot, dtypes, stage_port, deadline)
                else:
                    reply = self._stage(snapshot.chunks(cfg.chunk_bytes, dtypes), metadata=self._pusher.metadata,
                                        timeout=deadline)
            except grpc.RpcError as exc:
                failed, final = _failure("stage", exc, deadline), exc.code() in _FINAL
            except _Failed as exc:  # the stage port's: a connection refused or cut is tried again, as UNAVAILABLE
                failed, final = exc, exc.reason != "unavailable"
            else:
                result.bytes, result.stage_seconds = reply.bytes_received, reply.seconds
                return
            if final or attempt == cfg.retries or self._newer_pending():
                raise failed
            time.sleep(min(RETRY_PAUSE_S[0] * 2**attempt, RETRY_PAUSE_S[1]))

    def _stage_over_port(self, snapshot: Snapshot, dtypes: dict[str, torch.dtype], port: int,
                         deadline_s: float) -> pb.StageReply:
        """A Stage whose stream carries the manifest (with a fresh ticket) and the trailer, and whose bytes go
        on the server's stage port, sent from the snapshot as they are. When the port fails, the call's error
        when the server refused the Stage (it says why) or the deadline passed; else the port's own failure at
        stage ``stage``: ``timeout``, ``tls`` (the handshake) or ``unavailable`` (refused or cut)."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        trailer: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()

        def stream() -> Iterator[bytes]:
            yield snapshot.manifest_chunk(dtypes, ticket)
            last = trailer.get()
            if last is not None:
                yield last

        call = self._stage.future(stream(), metadata=self._pusher.metadata, timeout=deadline_s)
        host = self.target.address.rsplit(":", 1)[0].strip("[]")
        ends, sent = time.monotonic() + deadline_s, [0]
        try:
            digests = self._send(snapshot, dtypes, host, port, ticket, ends, call, sent)
        except OSError as exc:
            # The stream is still open, so an error the call ends with now is the server's, not a reaction to ours.
            refusal = None
            with contextlib.suppress(grpc.FutureTimeoutError, grpc.FutureCancelledError):
                refusal = call.exception(timeout=REFUSAL_WAIT_S)
            trailer.put(None)  # ends the stream (its thread waits on this queue)
            call.cancel()
            if isinstance(refusal, grpc.RpcError) and (refusal.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                                                       or REASON_KEY in dict(refusal.trailing_metadata() or ())):
                raise refusal from None
            where = f"stage: data to {host}:{port} after {sent[0]} of {snapshot.nbytes} bytes"
            if isinstance(exc, TimeoutError):
                raise _Failed("stage", "timeout", f"{where}: no progress by the Stage's {deadline_s:.3g} s "
                                                  "deadline") from None
            raise _Failed("stage", "tls" if isinstance(exc, ssl.SSLError) else "unavailable",
                          f"{where}: {exc!r}") from None
        except BaseException:
            trailer.put(None)
            call.cancel()
            raise
        trailer.put(trailer_chunk(digests))
        return call.result()

    def _send(self, snapshot: Snapshot, dtypes: dict[str, torch.dtype], host: str, port: int, ticket: bytes,
              ends: float, call: grpc.Future, sent: list[int]) -> list[int]:
        """The ticket, then the payload, then the server's word that every byte arrived; returns the tensors'
        digests. ``sent[0]`` counts the bytes sent."""
        cfg = self._config
        timeout = max(min(cfg.connect_timeout_s, ends - time.monotonic()), 1e-3)
        tls = self._pusher.ssl_context
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                (tls.wrap_socket(raw, server_hostname=cfg.tls_server_name or host) if tls is not None
                 else contextlib.nullcontext(raw)) as sock:
            sock.sendall(ticket)
            digests: list[int] = []
            for _, pieces in snapshot.slices(cfg.chunk_bytes, dtypes, digests):
                if call.done():  # refused, or past its deadline: the caller reports why
                    raise ConnectionAbortedError("the Stage call ended")
                for piece in pieces:
                    sock.settimeout(max(ends - time.monotonic(), 1e-3))
                    sock.sendall(piece)
                    sent[0] += piece.nbytes
            sock.settimeout(max(ends - time.monotonic(), 1e-3))
            if sock.recv(1) != DATA_RECEIVED:  # a cut connection; or the receiver failed, and its call will say
                raise ConnectionError("the connection closed before the server had every byte")
            return digests

    def _commit(self, snapshot: Snapshot, result: PushResult) -> None:
        """Commit with retries (backing off); a failed load stays staged on the server, so a retry can work.
        An adapter's commit is then verified against the checksum the engine reports."""
        cfg, version = self._config, snapshot.version
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(min(RETRY_PAUSE_S[0] * 2**attempt, RETRY_PAUSE_S[1]))
            self._pusher._check_fence()
            result.commit_attempts += 1
            try:
                reply = self._stub.Commit(pb.CommitRequest(version=version), metadata=self._pusher.metadata,
                                          timeout=cfg.commit_timeout_s)
            except grpc.RpcError as exc:
                status = self._serving(version) if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else None
                if status is not None:
                    self._verify(snapshot, status.adapter_checksum)
                    return
                if exc.code() in _FINAL or attempt == cfg.retries:
                    raise _failure("commit", exc, cfg.commit_timeout_s) from None
                continue
            result.pause_seconds, result.load_seconds = reply.pause_seconds, reply.load_seconds
            self._verify(snapshot, reply.adapter_checksum)
            return

    def _serving(self, version: int) -> pb.StatusReply | None:
        """The server's Status when it serves ``version``: a retried Commit whose first try landed."""
        try:
            status = self._stub.Status(pb.StatusRequest(), metadata=self._pusher.metadata,
                                       timeout=self._config.connect_timeout_s)
        except grpc.RpcError:
            return None
        return status if status.current_version == version else None

    @staticmethod
    def _verify(snapshot: Snapshot, served: str) -> None:
        """An adapter counts as delivered only when the engine reports serving exactly the bytes pushed."""
        if snapshot.adapter_checksum and served != snapshot.adapter_checksum:
            raise _Failed("verify", "mismatch", f"verify: version {snapshot.version}: the engine serves an adapter "
                                                f"with checksum {served or '(none)'}, the trainer pushed "
                                                f"{snapshot.adapter_checksum}")


def _status_dtypes(status: pb.StatusReply) -> dict[str, torch.dtype]:
    """The torch dtype of each tensor a server's Status lists; ``_Failed`` at stage ``connect`` naming a tensor whose
    dtype pushes do not support (a server of another rollwave release, say), before anything is staged."""
    for t in status.served:
        if t.dtype not in DTYPES:
            raise _Failed("connect", "dtype", f"connect: the server says it serves tensor {t.name} in dtype "
                                              f"{t.dtype!r}, which pushes do not support ({', '.join(DTYPES)})")
    return {t.name: getattr(torch, t.dtype) for t in status.served}


def groups_trained(staleness: StalenessControl | None, unacked: int) -> int:
    """What a pushed version was trained on, for admission: the buffer's run-wide count of trained groups plus
    the ``unacked`` ones in the weights that the buffer has not counted yet (0 without a buffer)."""
    return staleness.trained() + unacked if staleness is not None else 0


def registered_servers(registry: ServerRegistry) -> Callable[[], list[Target]]:
    """The registry's live rollout servers with a gRPC address, read again at every push."""
    return lambda: [Target(s.server_id, s.grpc_address, s.version, started=s.started)
                    for s in registry.live_servers() if s.grpc_address]


def quorum_of(setting: int | str, live: int) -> int:
    """Commits a version needs: ``majority`` of ``live`` (1 when there is one or none), ``all``, or a number."""
    if setting == "majority":
        return live // 2 + 1
    if setting == "all":
        return max(live, 1)
    return int(setting)


class CheckpointPusher:
    """Pushes versions to the servers that ``servers()`` lists (``Target``s, or plain ``host:port``s)."""

    def __init__(self, config: CheckpointConfig, servers: Sequence[str] | Callable[[], Sequence[Target]],
                 staleness: StalenessControl | None = None, *,
                 record: Callable[[str, PushRecord], None] | None = None,
                 registry: CollectorRegistry | None = None, pin_memory: bool = False,
                 fence: Callable[[], None] | None = None):
        """``fence`` raises ``TrainerFenced`` once a newer trainer of the run started (``ReplayBuffer.check_fence``):
        asked before each Commit."""
        self.config = config
        self._fence = fence
        self.refused: TrainerFenced | None = None  # the first Commit a newer trainer of the run refused
        if callable(servers):
            self._servers = servers
        else:
            static = [Target(a, a, named=False) for a in servers]
            self._servers = lambda: static
        self._staleness = staleness
        self._record = record
        self.metrics = PushMetrics(registry)
        self.token = config.token.get_secret_value()
        self.metadata = [("authorization", f"Bearer {self.token}")]
        self.channel_credentials = channel_credentials(config)
        self.ssl_context: ssl.SSLContext | None = ssl_context(config, server_side=False)  # the stage port's
        self.published = 0
        self.last_pushed = 0
        self._newest: Snapshot | None = None
        self._trainer_dtypes: dict[str, torch.dtype] = {}  # the model's, by tensor name, before a snapshot's cast
        self._rounds: dict[int, PushRound] = {}
        self._links: dict[str, _Link] = {}
        self._live: list[Target] = []
        self._stranded: set[str] = set()  # ids of the live servers that the newest version cannot be sent to (cast)
        self._finished: deque[PushResult] = deque(maxlen=4096)
        self._pool = BufferPool(pin=pin_memory)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def push_model(self, model: torch.nn.Module, version: int | None = None, unacked: int = 0
                   ) -> PushRound | None:
        """Snapshot ``model`` (FSDP2-sharded or plain) as ``version`` (default: the next) and hand it to the
        servers; every rank calls this (the all-gathers are collectives), rank 0 pushes and gets the round,
        others get None. Floating tensors are cast to the dtypes the servers serve (``push``). A LoRA model
        pushes its adapter alone, in the trainer's dtype (the engine casts it). ``unacked``: groups trained into
        the model that the buffer has not counted yet (acks wait for a checkpoint)."""
        lora = is_lora(model)
        params = iter_adapter_params(model) if lora else iter_full_params(model)
        if not _pushes(params):
            return None
        if lora:
            metas, config = adapter_metas(model), adapter_config_json(model)
        else:
            metas, config = model_metas(model), ""
        return self.push(metas, params, version, config, unacked)  # type: ignore[arg-type]

    def push(self, metas: Sequence[TensorMeta], tensors: Iterable[tuple[str, torch.Tensor]],
             version: int | None = None, adapter_config: str = "", unacked: int = 0) -> PushRound:
        """Snapshot ``tensors`` (in ``metas`` order) as ``version`` (default: above every version pushed,
        published or served) and offer it to every live server; returns at once. ``adapter_config`` (peft's
        adapter_config.json) makes it an adapter push, whose delivery each server's commit must verify.
        The groups the tensors were trained on (the buffer's count plus ``unacked``) are published with it.
        Full weights are snapshotted in the dtypes every live server serves (``_served_dtypes``)."""
        start = time.perf_counter()
        trained = groups_trained(self._staleness, unacked)
        targets = self._list_servers()
        if version is None:
            version = max([self.last_pushed, self.published, *(t.version for t in targets)]) + 1
        with self._lock:
            pending = self._rounds.get(version)
        if pending is not None and not pending.final:  # its round would be replaced, and a wait on it never end
            raise ValueError(f"version {version} is being pushed already: wait for its round to end before pushing "
                             "it again")
        if not adapter_config:
            self._trainer_dtypes = {m.name: m.dtype for m in metas}
            metas = cast_metas(metas, self._served_dtypes(targets))
        snapshot = take_snapshot(version, metas, tensors, self._pool, adapter_config)
        rnd = PushRound(version, targets, time.perf_counter() - start, trained)
        with self._lock:
            self.last_pushed = max(self.last_pushed, version)
            self._rounds[version] = rnd
            for old in [v for v, r in self._rounds.items() if v < version and r.final]:
                del self._rounds[old]
            previous, self._newest = self._newest, snapshot
            for target in targets:
                self._link(target).offer(snapshot)
        if previous is not None:
            previous.release()
        if not targets:
            log.warning("version %d: no live rollout server to push it to; servers get it when they register",
                        version)
        self._start_watcher()
        return rnd

    def take_results(self) -> list[PushResult]:
        """Results that arrived since the last call (for the step's record)."""
        with self._lock:
            done = list(self._finished)
            self._finished.clear()
        return done

    def flush(self, timeout_s: float | None = None) -> list[str]:
        """Wait until no push is pending or in flight (default: one push's deadlines, each of its tries and the
        pauses between them); the servers still being pushed to then, each as ``server_id (address)``."""
        if timeout_s is None:
            cfg = self.config
            nbytes = self._newest.nbytes if self._newest is not None else 0
            stage = cfg.stage_timeout_s + nbytes / (cfg.min_throughput_mib_s * 2**20)
            tries = cfg.retries + 1
            timeout_s = cfg.connect_timeout_s + tries * (stage + cfg.commit_timeout_s + 2 * RETRY_PAUSE_S[1])
        deadline = time.monotonic() + timeout_s
        while busy := [link.target for link in list(self._links.values()) if not link.idle]:
            if time.monotonic() > deadline:
                return [f"{t.server_id} ({t.address})" for t in busy]
            time.sleep(0.05)
        if self.refused is not None:  # raised here, in the trainer's thread: the link's thread only records it
            raise self.refused
        return []

    def _check_fence(self) -> None:
        """Before a Commit: ``_Failed`` at stage ``fence`` once a newer trainer of the run started (``refused`` keeps
        it for ``flush``), or when Redis cannot tell: nothing is committed that the newer trainer would not know of."""
        if self._fence is None:
            return
        try:
            self._fence()
        except TrainerFenced as exc:
            self._refuse(exc)
            raise _Failed("fence", "fenced", f"fence: {exc}") from None
        except redis.RedisError as exc:
            error = f"fence: the trainer epoch cannot be read, so nothing is committed: {exc}"
            raise _Failed("fence", "unavailable", error) from None

    def _refuse(self, exc: TrainerFenced) -> None:
        """Keep a refusal (logged and counted where it was refused) for ``flush`` to raise in the trainer's thread."""
        with self._lock:
            self.refused = self.refused or exc

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        with self._lock:
            links, self._links = list(self._links.values()), {}
            newest, self._newest = self._newest, None
        for link in links:
            link.close()
        for link in links:
            link.join()
        if newest is not None:
            newest.release()

    def _served_dtypes(self, targets: Sequence[Target]) -> dict[str, torch.dtype] | None:
        """The dtype each tensor has on every one of ``targets``, learned from their Status: the snapshot is cast
        to it once (fp32 masters to a bf16 fleet's bf16). A tensor the servers disagree on keeps the trainer's
        dtype, and so does every tensor while a server has not answered yet (in its present incarnation: one restarted
        under its id may serve others): each stream then casts from the trainer's precision to its server's own dtype,
        and a fp32 server never gets bf16-rounded weights."""
        with self._lock:
            links = [self._links.get(t.address) for t in targets]
            known = [dtypes for link, t in zip(links, targets, strict=True)
                     if link is not None and (dtypes := link.dtypes_of(t)) is not None]
        if not known or len(known) != len(targets):
            return None
        first, *others = known
        return {name: dtype for name, dtype in first.items() if all(o.get(name) == dtype for o in others)}

    def rounded_for(self, snapshot: Snapshot, served: dict[str, torch.dtype]) -> str:
        """The tensors ``snapshot`` holds cast from the trainer's dtypes (for the servers live when it was taken) to one
        that a server serving ``served`` does not serve, in words ('' when none): sent, its stream would cast them
        back, and a fp32 server would load bf16-rounded weights. A snapshot in the trainer's dtypes suits
        every server (each stream casts it to its server's), so only a catch-up after a restart in another dtype, or
        a push racing one, is refused."""
        trainer = self._trainer_dtypes
        rounded = [m for m in snapshot.metas
                   if m.dtype != trainer.get(m.name, m.dtype) and served.get(m.name, m.dtype) != m.dtype]
        if not rounded:
            return ""
        first, more = rounded[0], f" and {len(rounded) - 1} more" if len(rounded) > 1 else ""
        serves = str(served[first.name]).removeprefix("torch.")
        return f"tensor {first.name} in {first.dtype_name}{more} (this server serves {serves})"

    def _link(self, target: Target) -> _Link:
        link = self._links.get(target.address)
        if link is None or link.target.server_id != target.server_id:
            if link is not None:  # another server now listens there
                link.close()
            link = self._links[target.address] = _Link(target, self)
        link.target = target
        return link

    def _list_servers(self) -> list[Target]:
        try:
            self._live = list(self._servers())
        except redis.RedisError as exc:
            log.warning("cannot list the rollout servers (%s); pushing to the last known ones", exc)
        return self._live

    def _start_watcher(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True, name="push-watcher")
            self._watcher.start()

    def _watch(self) -> None:
        """Every ``WATCH_S``: catch up the live servers, publish what the live set's quorum now holds."""
        while not self._stop.wait(WATCH_S):
            targets = self._list_servers()
            with self._lock:
                self._catch_up(targets)
                quorum = quorum_of(self.config.quorum, len(targets))
                ready = [r for r in self._rounds.values() if not r.published and r.commits >= quorum]
            if ready:
                self._publish(max(ready, key=lambda r: r.version))

    def _catch_up(self, targets: list[Target]) -> None:
        """Offer the newest version to live servers that lack it (``_Link.serves``) and are not backing off (none once
        a newer trainer of the run refused a commit), else ask a server listed by address alone its Status (a restart);
        drop the links of servers that left."""
        newest, now = None if self.refused is not None else self._newest, time.monotonic()
        for target in targets:
            link = self._link(target)
            if newest is None or not link.idle:
                continue
            # a snapshot cast for it was refused already (logged, counted): this incarnation waits for the next version,
            # or for the trainer's re-push of this one (``repush_model``)
            if link.serves(target) < newest.version and now >= link.retry_at and not self._cast_away(link, target):
                link.offer(newest)
            elif not target.named:  # no registry tells its restarts: its Status does
                link.probe()
        addresses = {t.address for t in targets}
        for address in [a for a, link in self._links.items() if a not in addresses and link.idle]:
            self._links.pop(address).close()

    def _cast_away(self, link: _Link, target: Target) -> bool:
        """Whether the newest snapshot is cast to a dtype that ``target``'s present incarnation, as ``link`` read it,
        does not serve (a catch-up would be refused: ``rounded_for``)."""
        dtypes = link.dtypes_of(target)
        return self._newest is not None and dtypes is not None and bool(self.rounded_for(self._newest, dtypes))

    def _stranded_links(self) -> list[_Link]:
        """The links of the live servers that lack the newest version and that its snapshot cannot be sent to
        (``_cast_away``), idle and past their back-off (a failed re-push is tried again after it); none once a newer
        trainer of the run refused a commit."""
        with self._lock:
            newest, now = None if self.refused is not None else self._newest, time.monotonic()
            if newest is None:
                return []
            links = [(link, t) for t in self._live if (link := self._links.get(t.address)) is not None
                     and link.target.server_id == t.server_id]
            return [link for link, t in links if link.idle and now >= link.retry_at
                    and link.serves(t) < newest.version and self._cast_away(link, t)]

    def repush_due(self) -> int:
        """The newest version when a live server is stranded (it cannot be sent the newest snapshot, which is cast to a
        dtype it does not serve) and a push to it is due (``_stranded_links``), else 0; rank 0's, which the trainer
        shares with its other ranks before they all call ``repush_model`` (no step trained since that version) or
        ``push_model`` (steps trained since: a new version)."""
        with self._lock:
            return self._newest.version if self._newest is not None and self._stranded_links() else 0

    def repush_model(self, model: torch.nn.Module, version: int) -> list[str] | None:
        """Push ``version``, the newest, again from ``model``, which must hold exactly its weights in the trainer's
        precision (no step trained since it was pushed), to the stranded servers alone (``repush_due``), each stream
        casting it to its server's dtypes; nothing is published anew and no other server is sent anything. Their
        commits count in the version's round. A fleet restarted in another dtype after the newest version used to stay
        on its base weights, its groups too stale to train, and no newer version ever came. Every rank calls this (the
        all-gathers are collectives); rank 0 returns the servers it offered the snapshot to, others None. The snapshot's
        buffer is a one-off, freed once sent: pooled, a buffer in the trainer's precision stayed beside the versions'
        cast ones for ever (twice their host memory for a bf16 fleet)."""
        params = iter_full_params(model)
        if not _pushes(params):
            return None
        snapshot = take_snapshot(version, model_metas(model), params, None)
        try:
            with self._lock:
                if self._newest is None or self._newest.version != version:
                    newest = self._newest.version if self._newest is not None else None
                    raise ValueError(f"version {version} is not the newest ({newest}): only the newest is pushed again")
                links = self._stranded_links()
                for link in links:
                    link.offer(snapshot)
        finally:
            snapshot.release()
        servers = [f"{link.target.server_id} ({link.target.address})" for link in links]
        if servers:
            log.warning("version %d pushed again, in the trainer's precision, to %s: its snapshot is cast to a dtype "
                        "they do not serve (restarted in another), and no step was trained since", version,
                        ", ".join(servers))
        return servers

    def _finish(self, result: PushResult) -> None:
        """Account one result: metrics, the registry record, the log, the version's quorum."""
        if not result.skipped:
            if not result.ok:
                self.metrics.failures.labels(result.stage, result.reason).inc()
                log.warning("push of version %d failed: %s", result.version, result.error)
            if result.ok or result.reason == "cast":  # another failure leaves it as it was
                self._strand(result.server_id, not result.ok)
            if result.reason == "cast":
                log.error("server %s (%s) stays on version %d, behind the newest, %d, until the trainer pushes a newer "
                          "version (ahead of schedule while it waits for data), or this one again (while it waits for "
                          "data with no step trained since): version %d is kept only cast to a dtype this server does "
                          "not serve (no second full copy is kept)",
                          result.server_id, result.address, result.serves, result.version, result.version)
            if self._record is not None and result.reason != "fenced":  # the newer trainer's pushes are the record
                try:
                    self._record(result.server_id, result.record())
                except TrainerFenced as exc:
                    self._refuse(exc)
                except redis.RedisError as exc:
                    log.warning("cannot record the push result of %s: %s", result.server_id, exc)
        with self._lock:
            self._finished.append(result)
            rnd = self._rounds.get(result.version)
            if rnd is None:
                return
            rnd.add(result)
            quorum = quorum_of(self.config.quorum, len(self._live))
            publish = not rnd.published and rnd.commits >= quorum
            rnd.published |= publish
            report = rnd.final and not rnd.published and not rnd.reported
            rnd.reported |= report
        if publish:
            self._publish(rnd)
        if report and any(not s.ok and not s.skipped for s in rnd.servers):
            self.metrics.unpublished.inc()
            reasons = "; ".join(s.error or f"server {s.server_id}: skipped for a newer version"
                                for s in rnd.servers if not s.ok)
            where = f"on {rnd.commits} of {len(rnd.targets)} servers" if rnd.commits else "on no server"
            log.error("version %d not published: committed %s, quorum %d. %s", rnd.version, where, quorum, reasons)

    def _strand(self, server_id: str, stranded: bool) -> None:
        """Count ``server_id`` among the servers the newest version cannot be sent to, or no longer (a version reached
        it, or it left)."""
        with self._lock:
            if stranded:
                self._stranded.add(server_id)
            else:
                self._stranded.discard(server_id)
            self.metrics.stranded.labels("cast").set(len(self._stranded))

    def _publish(self, published: PushRound) -> None:
        version = published.version
        with self._lock:
            for rnd in self._rounds.values():
                rnd.published |= rnd.version <= version
            if version <= self.published:
                return
            self.published = version
        log.info("version %d published", version)
        if self._staleness is not None:
            try:
                self._staleness.set_version(version, published.trained)
            except TrainerFenced as exc:
                self._refuse(exc)
            except redis.RedisError as exc:
                log.error("version %d committed by a quorum but not recorded in Redis: %s", version, exc)

