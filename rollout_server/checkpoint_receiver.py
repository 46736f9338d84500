"""Checkpoint receiver: the gRPC ``CheckpointEngine`` of one rollout server.

Stage writes a pushed version as an HF model directory on tmpfs while the engine keeps
generating; Commit has the engine read it (``prepare_weights_from_disk``, still generating), then pauses it
only for ``update_weights_from_disk`` of that directory, which then swaps it in. A LoRA
adapter's push (``Manifest.adapter_config``) is staged as a peft adapter directory instead and Commit loads
it by name (``/load_lora_adapter``, replacing the one served), reports the checksum the engine gives for it
(so the pusher verifies the delivery) and tells the rollout worker to name it on its requests.
The manifest is checked against the served model before any byte is accepted, and a stage
that fails (bad manifest, checksum, offsets, cut stream, a staging area that cannot take it) is deleted: the
server keeps its version.
A Stage's bytes come over the server's stage port (``rollout_server.stage_port``) when its
manifest carries a ticket, else in the stream itself. The server is ``grpc.aio`` on the rollout server's
event loop, so Commit awaits the same async engine client the agent loop uses. Every call needs the
checkpoint token except ``Prove``, which answers the pusher's challenge (``core.checkpoint_auth``) before
the pusher sends the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from safetensors.torch import load_file

from core.checkpoint_auth import NONCE_BYTES, proof, server_credentials, ssl_context
from core.checkpoint_format import (
    GRPC_OPTIONS,
    MODEL_WEIGHTS,
    REASON_KEY,
    SERVICE,
    StagedFile,
    StageError,
    check_manifest,
    parse_chunk,
    served_tensor_specs,
)
from core.config import CheckpointConfig
from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_checksum
from core.net import bind_retrying, listen_socket
from proto import checkpoint_pb2 as pb
from rollout_server.engine_client import EngineClient, EngineError, EngineGroup
from rollout_server.stage_port import IncomingData, StagePort, storage_error

log = logging.getLogger(__name__)
RESUME_BACKOFF_S = (0.1, 5.0)  # between tries of a failed continue_generation: first, longest (doubling)


class WeightEngine(Protocol):
    """What Commit needs from the engine client (``rollout_server.engine_client.EngineClient``)."""

    async def pause(self, mode: str = ...) -> Any: ...
    async def prepare_weights_from_disk(self, model_path: str, prefill_running: bool = False) -> bool: ...
    async def resume(self, torch_empty_cache: bool = ...) -> Any: ...
    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = ...,
                                       flush_cache: bool = ...) -> Any: ...
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any] | list[dict[str, Any]]: ...
    async def unload_lora_adapter(self, lora_name: str) -> Any: ...
    async def update_weight_version(self, version: str) -> Any: ...


class CheckpointMetrics:
    """Checkpoint metrics of one rollout server, in its own (or a given) registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.stage_seconds = Histogram("rollwave_rollout_stage_duration_seconds", "Stage stream duration",
                                       registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.stage_bytes = Counter("rollwave_rollout_stage_bytes", "bytes staged, by how they came (port: the "
                                   "stage port; stream: in the Stage call)", ["transport"], registry=r)
        self.pause_seconds = Histogram(  # from 1 ms: a Commit's pause is 2-11 ms (bench/RESULTS.md)
            "rollwave_rollout_pause_duration_seconds", "pause per Commit", registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.paused_seconds = Counter("rollwave_rollout_paused_seconds", "time paused for weight loads",
                                      registry=r)
        self.version = Gauge("rollwave_rollout_policy_version", "committed policy version", registry=r)
        self.stage_failures = Counter("rollwave_rollout_stage_failures", "rejected or failed stages",
                                      ["reason"], registry=r)
        self.commit_failures = Counter("rollwave_rollout_commit_failures", "failed commits", ["reason"],
                                       registry=r)
        self.resume_failures = Counter("rollwave_rollout_resume_failures", "failed continue_generation calls after "
                                       "a pause, each tried again until the engines continue (resume_timeout: no "
                                       "answer within checkpoint.pause_timeout_s)", ["reason"], registry=r)
        self.refused = Counter("rollwave_rollout_checkpoint_refused", "checkpoint calls refused before they ran "
                               "(unauthenticated: no or a wrong token; certificate: the caller's certificate lacks "
                               "checkpoint.tls_client_name; nonce: a malformed challenge; and stage port "
                               "connections: handshake_timeout, no TLS handshake and ticket within "
                               "checkpoint.connect_timeout_s; tls: a failed handshake; ticket: a ticket no Stage in "
                               "progress holds; busy: every slot for a Stage not yet begun taken)", ["reason"],
                               registry=r)
        self.aborts = Counter("rollwave_rollout_stage_aborts", "Abort calls by outcome (dropped: the staged version "
                              "was deleted; not_staged: the version named was not the one staged)", ["outcome"],
                              registry=r)
        self.swap_fallbacks = Counter("rollwave_rollout_swap_fallbacks", "Commits that went on the slower way "
                                      "(prepare: prepare_weights_from_disk, with the KV ahead when asked, failed so "
                                      "the load reads the files in the pause; prepare_timeout: no answer to it within "
                                      "checkpoint.pause_timeout_s; late_pause: a pause that answered after its "
                                      "deadline failed, the engines are continued all the same)", ["reason"],
                                      registry=r)


@dataclass
class _Swap:
    """One Commit's pause: durations, whether the engine took the weights, and what went wrong."""

    pause_s: float = 0.0
    load_s: float = 0.0
    loaded: bool = False
    error: str = ""
    reason: str = ""
    adapter_checksum: str = ""  # an adapter's load: what the engines report serving


@dataclass
class _State:
    current: int
    current_dir: Path
    staged: int = -1
    staged_dir: Path | None = None
    committing: int = -1


class CheckpointService:
    """Stage/Commit/Abort/Status over one served model directory and one engine."""

    def __init__(self, config: CheckpointConfig, model_dir: Path, stage_root: Path, engine: WeightEngine,
                 engine_url: str, version: int, metrics: CheckpointMetrics, *, server_id: str,
                 adapter_name: str = "policy", on_adapter: Callable[[str | None], None] | None = None,
                 on_commit: Callable[[int], None] | None = None):
        self.config = config
        self.adapter_name = adapter_name
        self.on_adapter = on_adapter or (lambda _name: None)
        self.on_commit = on_commit or (lambda _version: None)  # the worker admits by the version it serves
        self.adapter_checksum = ""  # of the adapter served; "" while full weights serve
        self.model_dir = Path(model_dir)
        self.stage_root = Path(stage_root)
        self.engine = engine
        self.engine_url = engine_url
        self.metrics = metrics
        self.server_id = server_id
        self.address = ""  # the gRPC address the server is reached at (bound into its proofs), set on start
        self.stage_port: StagePort | None = None  # set on start
        self.max_version_jump = config.max_version_jump
        self._token = config.token.get_secret_value()
        self.served = served_tensor_specs(self.model_dir)
        self._state = _State(current=version, current_dir=self.model_dir)
        self._stage_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self._late: set[asyncio.Task[None]] = set()  # continues owed to pauses that answered late
        self._closing = asyncio.Event()  # set by close(): a continue still failing is tried no more
        metrics.version.set(version)

    @property
    def current_version(self) -> int:
        return self._state.current

    def close(self) -> None:
        """The receiver stops: a continue that keeps failing is given up after its try in flight."""
        self._closing.set()

    def handlers(self) -> grpc.GenericRpcHandler:
        """The service's method handlers; Stage takes raw bytes so ``parse_chunk`` can avoid copies."""
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Stage": grpc.stream_unary_rpc_method_handler(
                self.Stage, response_serializer=pb.StageReply.SerializeToString),
            "Commit": unary(self.Commit, pb.CommitRequest.FromString, pb.CommitReply.SerializeToString),
            "Abort": unary(self.Abort, pb.AbortRequest.FromString, pb.AbortReply.SerializeToString),
            "Status": unary(self.Status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString),
            "Prove": unary(self.Prove, pb.ProveRequest.FromString, pb.ProveReply.SerializeToString),
        })

    async def Stage(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> pb.StageReply:
        """Receives serialized chunks (see ``parse_chunk``) and stages the version they carry."""
        peer = context.peer() or "a caller gone before the call began"  # gRPC forgets it once the call is cancelled
        async with self._stage_lock:
            start = time.monotonic()
            remaining = context.time_remaining()
            deadline = start + (remaining if remaining is not None else self.config.stage_timeout_s)
            try:
                # a caller that set no deadline holds the stage lock only as long as a pusher's would (gRPC ends
                # the call of one that did)
                own = asyncio.timeout_at(deadline) if remaining is None else None
                try:
                    async with own or contextlib.nullcontext():
                        version, received, transport = await self._stage(request_iterator, deadline, own)
                except TimeoutError:
                    limit = (own.when() if own is not None else deadline) - start
                    raise StageError("timeout", f"Stage from {peer} not done within {limit:.3g} s",
                                     grpc.StatusCode.DEADLINE_EXCEEDED) from None
            except StageError as exc:
                self.metrics.stage_failures.labels(exc.reason).inc()
                log.warning("%s: stage refused (%s): %s", self.server_id, exc.reason, exc)
                await context.abort(exc.code, str(exc), trailing_metadata=((REASON_KEY, exc.reason),))
            except asyncio.CancelledError:
                self.metrics.stage_failures.labels("stream").inc()
                log.warning("%s: Stage from %s cancelled (its deadline passed or its caller went away)",
                            self.server_id, peer)
                raise
            seconds = time.monotonic() - start
            self.metrics.stage_seconds.observe(seconds)
            self.metrics.stage_bytes.labels(transport).inc(received)
            return pb.StageReply(version=version, bytes_received=received, seconds=seconds)

    async def _stage(self, chunks: AsyncIterator[bytes], deadline: float,
                     own: asyncio.Timeout | None) -> tuple[int, int, str]:
        """(version, bytes, how the bytes came) of the version the stream stages. ``own``: the receiver's deadline
        for a caller that set none; once the manifest tells the size, it grows by the bytes over
        ``checkpoint.min_throughput_mib_s``, as a pusher's deadline does."""
        first = await anext(chunks, None)
        kind, _, payload = parse_chunk(first or b"")
        if kind != "manifest":
            raise StageError("manifest", "the first chunk of a Stage stream must carry the manifest")
        manifest = _parse(pb.Manifest, payload, "manifest")
        if own is not None:  # total_bytes is checked against the tensors before any byte is taken
            deadline += manifest.total_bytes / (self.config.min_throughput_mib_s * 2**20)
            own.reschedule(deadline)
        port, incoming = self.stage_port, None
        if manifest.data_ticket:
            if port is None:
                raise StageError("manifest", "the manifest has a data_ticket, and this server has no stage port")
            incoming = port.expect(manifest.data_ticket, deadline)  # a refusal below frees its connection
        try:
            version, received = await self._stage_manifest(manifest, chunks, incoming)
            return version, received, "stream" if incoming is None else "port"
        finally:
            if port is not None and incoming is not None:
                port.forget(manifest.data_ticket)

    async def _stage_manifest(self, manifest: pb.Manifest, chunks: AsyncIterator[bytes],
                              incoming: IncomingData | None) -> tuple[int, int]:
        version = manifest.version
        self._check_newer(version)
        check_manifest(manifest, self.served)
        final = self.stage_root / f"v{version}"
        partial = self.stage_root / f"v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            partial.mkdir(parents=True)
            if manifest.adapter_config:
                (partial / ADAPTER_CONFIG).write_text(manifest.adapter_config)
            else:
                self._copy_model_files(partial)
                self._recycle_served_file(partial / MODEL_WEIGHTS)
            staged = StagedFile(partial / (ADAPTER_WEIGHTS if manifest.adapter_config else MODEL_WEIGHTS), manifest)
            try:
                if incoming is None:
                    await self._receive(chunks, staged)
                else:
                    await self._receive_over_port(chunks, staged, manifest.data_ticket, incoming)
            finally:
                staged.close()
            self._publish_stage(version, partial, final)
        except BaseException as exc:
            shutil.rmtree(partial, ignore_errors=True)
            if isinstance(exc, grpc.RpcError):
                raise StageError("stream", f"stream of version {version} broke: {exc}") from exc
            if isinstance(exc, OSError):
                raise storage_error(exc, f"version {version} ({manifest.total_bytes} bytes) cannot be staged in "
                                         f"{exc.filename or partial}") from exc
            raise
        return version, staged.received

    async def _receive(self, chunks: AsyncIterator[bytes], staged: StagedFile) -> None:
        async for chunk in chunks:
            kind, offset, payload = parse_chunk(chunk)
            if kind == "data":
                staged.write(offset, payload)
            elif kind == "trailer":
                staged.finish(_parse(pb.Trailer, payload, "stream"))
                if await anext(chunks, None) is not None:
                    raise StageError("stream", "data after the trailer")
                return
            else:
                raise StageError("manifest", f"a {kind or 'empty'} chunk after the manifest")
        raise StageError("stream", f"stream ended after {staged.received} of {staged.total} bytes "
                                   "without a trailer")

    async def _receive_over_port(self, chunks: AsyncIterator[bytes], staged: StagedFile, ticket: bytes,
                                 incoming: IncomingData) -> None:
        """The data comes on the stage port, the trailer in the stream; the connection's thread is done with
        ``staged`` when this returns, whatever happened. A connection that fails before the trailer comes ends the
        Stage at once with its cause: the pusher sends no trailer then, it waits for the call to say why."""
        assert self.stage_port is not None
        self.stage_port.ready(incoming, staged)
        done = asyncio.wrap_future(incoming.done)
        last = asyncio.ensure_future(anext(chunks, None))
        for future in (done, last):  # raised below, or moot: a Stage that ended (its deadline, its caller) cuts both
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({done, last}, return_when=asyncio.FIRST_COMPLETED)
            if done.done() and done.exception() is not None:
                done.result()
            kind, _, payload = parse_chunk(await last or b"")
            if kind != "trailer":
                raise StageError("stream", f"a {kind or 'missing'} chunk where a Stage with a data_ticket has its "
                                           "trailer (its data goes over the stage port)")
            trailer = _parse(pb.Trailer, payload, "stream")
            await asyncio.wait({done}, timeout=max(0.0, incoming.deadline - time.monotonic()))
            if not done.done():
                source = f"from {incoming.peer}" if incoming.peer else "(no connection presented its ticket)"
                raise StageError("timeout", f"{staged.received} of {staged.total} bytes on the stage port {source} "
                                            "by the Stage's deadline")
            done.result()  # the connection's StageError, if it failed
            staged.finish(trailer)
            if await anext(chunks, None) is not None:
                raise StageError("stream", "data after the trailer")
        finally:
            last.cancel()
            self.stage_port.forget(ticket)  # cuts a connection still receiving
            await asyncio.wait({done}, timeout=30.0)  # its thread settles at once after the cut
            if not done.done():
                log.error("%s: the stage port's thread did not stop within 30 s of its Stage's end", self.server_id)

    def _copy_model_files(self, dest: Path) -> None:
        for src in self.model_dir.iterdir():
            if src.is_file() and not src.name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy2(src, dest / src.name)

    def _recycle_served_file(self, dest: Path) -> None:
        """Move the served version's staged weights file to ``dest`` for the new stage to overwrite in place.

        Its tmpfs pages are already allocated: fresh ones are zeroed by the kernel first, a third of a Stage's
        time here. The engine holds the weights it serves in its own memory; nothing reads the file again.
        """
        served = self._state.current_dir
        if served.parent == self.stage_root:
            with contextlib.suppress(FileNotFoundError):
                (served / MODEL_WEIGHTS).rename(dest)

    def _check_newer(self, version: int) -> None:
        """Versions only go up past the one served (or being committed), by at most ``max_version_jump``
        (else one stage near 2^63 would leave the trainer no version to push); the staged slot holds the
        latest finished Stage, so a stale staged version never blocks a restarted trainer."""
        floor = max(self._state.current, self._state.committing)
        if version <= floor:
            raise StageError("version", f"version {version} is not newer than the served version {floor}",
                             grpc.StatusCode.FAILED_PRECONDITION)
        if version - floor > self.max_version_jump:
            raise StageError("version", f"version {version} is more than checkpoint.max_version_jump="
                                        f"{self.max_version_jump} above the served version {floor}",
                             grpc.StatusCode.FAILED_PRECONDITION)

    def _publish_stage(self, version: int, partial: Path, final: Path) -> None:
        """Make the finished stage the staged version, dropping the one staged before."""
        self._check_newer(version)
        old = self._state.staged_dir
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        self._state.staged, self._state.staged_dir = version, final
        if old is not None and old != final:
            shutil.rmtree(old, ignore_errors=True)

    async def Commit(self, request: pb.CommitRequest, context: grpc.aio.ServicerContext) -> pb.CommitReply:
        """The swap runs shielded from the call: a pusher that gives up (its deadline passed) never leaves
        the engine paused or the state half-changed; the swap finishes and the version serves. The reply comes
        once the engines generate again: a continue that fails is tried until it works (see ``_resume``), so a
        pusher whose deadline passes first sees a timeout, and its next offer finds the version served."""
        commit = asyncio.ensure_future(self._commit(request.version))
        commit.add_done_callback(partial(self._log_commit, request.version))
        try:
            return await asyncio.shield(commit)
        except StageError as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=((REASON_KEY, exc.reason),))

    def _log_commit(self, version: int, commit: asyncio.Task[pb.CommitReply]) -> None:
        """Log a failed commit once it ends, also when the call that asked for it was gone by then."""
        exc = None if commit.cancelled() else commit.exception()
        if isinstance(exc, StageError):
            log.warning("%s: commit of version %d failed (%s): %s", self.server_id, version, exc.reason, exc)
        elif exc is not None:
            log.error("%s: commit of version %d failed", self.server_id, version, exc_info=exc)

    async def _commit(self, version: int) -> pb.CommitReply:
        async with self._commit_lock:
            state = self._state
            if version != state.staged or state.staged_dir is None:
                self.metrics.commit_failures.labels("version").inc()
                raise StageError("version", f"version {version} is not staged (staged {state.staged}, "
                                            f"current {state.current})", grpc.StatusCode.FAILED_PRECONDITION)
            path = state.staged_dir
            state.staged, state.staged_dir, state.committing = -1, None, version
            swap = await self._swap(path, version)
            state.committing = -1
            if swap.loaded:
                old = state.current_dir
                state.current, state.current_dir = version, path
                self.metrics.version.set(version)
                self.on_commit(version)
            elif state.staged_dir is None:  # keep it staged so the pusher can retry the Commit
                old, state.staged, state.staged_dir = None, version, path
            else:  # a newer version was staged meanwhile
                old = path
            if old is not None and old.parent == self.stage_root:
                shutil.rmtree(old, ignore_errors=True)
            if swap.error:
                self.metrics.commit_failures.labels(swap.reason).inc()
                timed_out = swap.reason.endswith("_timeout")
                code = grpc.StatusCode.DEADLINE_EXCEEDED if timed_out else grpc.StatusCode.INTERNAL
                raise StageError(swap.reason, f"version {version}: {swap.error}", code)
            return pb.CommitReply(version=version, pause_seconds=swap.pause_s, load_seconds=swap.load_s,
                                  adapter_checksum=swap.adapter_checksum)

    async def _swap(self, path: Path, version: int) -> _Swap:
        """prepare -> pause -> update_weights_from_disk -> continue; continue even when the load fails.

        The pause is ``retract`` (the running requests' KV is recomputed) or, with ``kv_on_swap: keep``,
        ``in_place``, and then the load keeps the prefix cache too (``flush_cache`` false; SGLang's flush would
        fail with requests running). Preparing (full weights only, unless ``checkpoint.prepare_weights`` is off)
        reads the staged files into the engine's spare parameters before the pause, and under ``recompute`` (unless
        ``checkpoint.prefill_ahead`` is off) has the engine compute the running requests' KV under them too, so
        the retracted requests prefill only what they generated since; an engine that cannot (SGLang) reads them
        inside the load, and a failed prepare leaves the load to report.

        The pause is timed from the moment the engine confirms it (generation has stopped; the engine
        finishes the decode step in progress first) to the moment continue returns. The pause has
        ``pause_timeout_s``: the version is refused, naming the stage. A pause that fails is followed by a
        continue at once, and one that answers late (or fails late) by its continue before any other swap: of
        several engines some may have paused, so none is left paused (a continue of an engine that is not paused
        does nothing, on the embedded engine and on SGLang)."""
        adapter = (path / ADAPTER_CONFIG).is_file()
        limit = self.config.pause_timeout_s
        if self.config.prepare_weights and not adapter:
            await self._prepare(path)
        pause = asyncio.ensure_future(self.engine.pause(self.config.swap_pause))
        try:
            await asyncio.wait_for(asyncio.shield(pause), limit)
        except EngineError as exc:
            swap = _Swap(error=f"pause failed, still serving the old weights: {exc}", reason="pause")
            await self._resume(swap)
            return swap
        except TimeoutError:
            late = asyncio.create_task(self._continue_late(pause))
            self._late.add(late)
            late.add_done_callback(self._late.discard)
            return _Swap(error=f"pause: no answer from the engine within {limit:g} s; still serving the old weights",
                         reason="pause_timeout")
        swap = _Swap()
        start = load_start = time.monotonic()
        try:
            if adapter:
                swap.adapter_checksum = await self._load_adapter(path, version)
            else:
                await self.engine.update_weights_from_disk(str(path), weight_version=str(version),
                                                           flush_cache=self.config.kv_on_swap == "recompute")
                await self._drop_adapter()
            swap.loaded = True
        except Exception as exc:  # whatever failed, the engines continue: none is left paused
            if not isinstance(exc, EngineError):
                log.exception("%s: loading version %d from %s failed", self.server_id, version, path)
            now = "continuing on the old weights"
            if adapter and not self.adapter_checksum:
                now = "the engine now serves the base weights without the adapter until the next push"
            swap.error, swap.reason = f"load failed, {now}: {exc}", "load"
        swap.load_s = time.monotonic() - load_start
        await self._resume(swap)
        swap.pause_s = time.monotonic() - start
        self.metrics.pause_seconds.observe(swap.pause_s)
        self.metrics.paused_seconds.inc(swap.pause_s)
        return swap

    async def _prepare(self, path: Path) -> None:
        """Prepare the staged version in the engines; a failure is a fallback (logged and counted), not a refusal:
        the load still works, only its pause is longer."""
        limit = self.config.pause_timeout_s
        prefill_running = self.config.prefill_ahead and self.config.kv_on_swap == "recompute"
        try:
            await asyncio.wait_for(self.engine.prepare_weights_from_disk(str(path), prefill_running), limit)
        except (EngineError, TimeoutError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            self.metrics.swap_fallbacks.labels("prepare_timeout" if timed_out else "prepare").inc()
            then = "the load reads it in the pause"
            if prefill_running:
                then += ", and the requests it retracts prefill in full after it (no KV computed ahead)"
            log.warning("%s: engine %s: prepare_weights_from_disk of %s (prefill_running %s) failed (%s); %s",
                        self.server_id, self.engine_url, path, prefill_running,
                        f"no answer within {limit:g} s" if timed_out else exc, then)

    async def _load_adapter(self, path: Path, version: int) -> str:
        """Load the staged adapter under ``adapter_name`` (replacing the one served) and return the checksum the
        engines report for it: one value when they agree, all of them when they do not (the pusher then
        refuses the delivery). An engine that reports none (SGLang) is checked by the file it was given."""
        try:
            replies = await self.engine.load_lora_adapter(self.adapter_name, str(path))
        except EngineError:
            if not self.adapter_checksum:
                raise
            # SGLang refuses a name it has loaded (the embedded engine replaces it): drop it, then load. Until that
            # load works the engines serve no adapter, and the worker names none (a request naming it would fail).
            await self._drop_adapter()
            replies = await self.engine.load_lora_adapter(self.adapter_name, str(path))
        reported = {(r.get("checksums") or {}).get(self.adapter_name)
                    for r in (replies if isinstance(replies, list) else [replies])}
        if None in reported:
            reported.discard(None)
            reported.add(await asyncio.to_thread(lambda: adapter_checksum(load_file(path / ADAPTER_WEIGHTS))))
        self.adapter_checksum = ",".join(sorted(reported))
        try:
            await self.engine.update_weight_version(str(version))
        except EngineError:
            # The engines hold the new adapter under the old version's number: the worker names it no more (and the
            # engines unload it), so no token is sampled from it and recorded under a version it is not.
            await self._drop_adapter()
            raise
        self.on_adapter(self.adapter_name)
        return self.adapter_checksum

    async def _drop_adapter(self) -> None:
        """Full weights replace an adapter: the engines unload it and the worker stops naming it."""
        if self.adapter_checksum:
            self.on_adapter(None)
            self.adapter_checksum = ""
            await self.engine.unload_lora_adapter(self.adapter_name)

    async def _continue_late(self, pause: asyncio.Future[Any]) -> None:
        """After a pause that missed its deadline: once it lands, or fails (of several engines some may have
        paused), continue the engines, holding the commit lock so no other swap runs in between."""
        async with self._commit_lock:
            try:
                await pause
            except EngineError as exc:
                self.metrics.swap_fallbacks.labels("late_pause").inc()
                log.warning("%s: engine %s: the late pause failed (%s); continuing the engines all the same",
                            self.server_id, self.engine_url, exc)
            swap = _Swap()
            await self._resume(swap)
            if swap.error:
                log.error("%s: engine %s: after a late pause, %s", self.server_id, self.engine_url, swap.error)

    async def _resume(self, swap: _Swap) -> None:
        """continue_generation, tried until it works (backing off, each failure logged and counted): an engine left
        paused generates nothing until the next version's commit, and with one server that never comes. The
        caller holds the commit lock, so no other swap runs meanwhile; only ``close()`` ends the tries, and then
        ``swap`` records the failure."""
        limit, delay = self.config.pause_timeout_s, RESUME_BACKOFF_S[0]
        while True:
            try:
                await asyncio.wait_for(self.engine.resume(self.config.empty_cache_on_resume), limit)
                return
            except (EngineError, TimeoutError) as exc:
                timed_out = isinstance(exc, TimeoutError)
                why = f"no answer from the engine within {limit:g} s" if timed_out else str(exc)
                reason = "resume_timeout" if timed_out else "resume"
            self.metrics.resume_failures.labels(reason).inc()
            if self._closing.is_set():
                swap.error = f"{swap.error}; continue_generation failed: {why} (the receiver is stopping)".lstrip("; ")
                swap.reason = reason
                log.error("%s: engine %s: continue_generation failed (%s); the receiver is stopping, the engine may "
                          "stay paused", self.server_id, self.engine_url, why)
                return
            log.error("%s: engine %s: continue_generation failed (%s); the engine stays paused, trying again in "
                      "%g s", self.server_id, self.engine_url, why, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), delay)
            delay = min(2 * delay, RESUME_BACKOFF_S[1])

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortReply:
        """A pusher gives up a staged version (its round failed elsewhere): drop it, logged and counted, so an
        operator sees why a staged version never served."""
        state = self._state
        if request.version != state.staged or state.staged_dir is None:
            self.metrics.aborts.labels("not_staged").inc()
            log.info("%s: Abort of version %d from %s: not staged (staged %d, current %d), nothing to drop",
                     self.server_id, request.version, context.peer(), state.staged, state.current)
            return pb.AbortReply(dropped=False)
        path = state.staged_dir
        state.staged, state.staged_dir = -1, None
        shutil.rmtree(path, ignore_errors=True)
        self.metrics.aborts.labels("dropped").inc()
        log.warning("%s: Abort of version %d from %s: dropped the staged version; still serving version %d",
                    self.server_id, request.version, context.peer(), state.current)
        return pb.AbortReply(dropped=True)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        served = [pb.TensorSpec(name=name, dtype=dtype, shape=list(shape))
                  for name, (dtype, shape) in self.served.items()]
        return pb.StatusReply(current_version=self._state.current, staged_version=self._state.staged,
                              engine_url=self.engine_url, served=served, adapter_checksum=self.adapter_checksum,
                              stage_port=self.stage_port.port if self.stage_port is not None else 0)

    async def Prove(self, request: pb.ProveRequest, context: grpc.aio.ServicerContext) -> pb.ProveReply:
        """The answer to the pusher's challenge: only a holder of the token can compute it, for this address."""
        if len(request.nonce) != NONCE_BYTES:
            self.metrics.refused.labels("nonce").inc()
            log.warning("%s: Prove from %s refused: a nonce of %d bytes, not %d", self.server_id, context.peer(),
                        len(request.nonce), NONCE_BYTES)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the nonce must be {NONCE_BYTES} bytes")
        return pb.ProveReply(server_id=self.server_id,
                             proof=proof(self._token, request.nonce, self.server_id, self.address))


_PROVE = f"/{SERVICE}/Prove"


def _parse(message: type[Message], payload: memoryview, reason: str) -> Any:
    """A Stage stream's manifest or trailer; bytes that do not parse are a refused stage, not a crash."""
    try:
        return message.FromString(payload)
    except DecodeError as exc:
        raise StageError(reason, f"the {message.DESCRIPTOR.name} does not parse: {exc}") from None


class CallerInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call run only for an allowed caller. Its ``authorization`` metadata must be ``Bearer <token>``
    (else UNAUTHENTICATED), except on ``Prove`` (the pusher proves nothing there, it checks the server's answer);
    with ``client_name`` (``checkpoint.tls_client_name`` on a TLS port) the caller's certificate must carry that
    name, on every call (else PERMISSION_DENIED): the CA may have signed others, such as the receivers' own."""

    def __init__(self, token: str, client_name: str | None, metrics: CheckpointMetrics):
        self._expected = f"Bearer {token}".encode()
        self._client_name = client_name
        self._metrics = metrics

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            metrics.refused.labels("unauthenticated").inc()
            log.warning("checkpoint call from %s refused: missing or wrong checkpoint token", context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong checkpoint token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if handler_call_details.method != _PROVE and not hmac.compare_digest(str(got).encode(), self._expected):
            return self._deny_stream if handler_call_details.method.endswith("/Stage") else self._deny_unary
        handler = await continuation(handler_call_details)
        if self._client_name is None or handler is None:
            return handler
        return self._named_caller_only(handler)

    def _named_caller_only(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` behind the check of the name in the caller's certificate."""
        stream = handler.stream_unary is not None
        behaviour = handler.stream_unary if stream else handler.unary_unary

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            auth = context.auth_context()
            names = sorted({name.decode(errors="replace") for field in ("x509_common_name",
                            "x509_subject_alternative_name") for name in auth.get(field, ())})
            if self._client_name not in names:
                self._metrics.refused.labels("certificate").inc()
                why = f"its certificate names {', '.join(names) or 'nothing'}, not {self._client_name}"
                log.warning("checkpoint call from %s refused (checkpoint.tls_client_name): %s", context.peer(), why)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"refused by checkpoint.tls_client_name: {why}")
            return await behaviour(request, context)

        make = grpc.stream_unary_rpc_method_handler if stream else grpc.unary_unary_rpc_method_handler
        return make(checked, handler.request_deserializer, handler.response_serializer)


class CheckpointReceiver:
    """The gRPC server of one rollout server, on the caller's event loop: ``await start()``, ``await stop()``.

    Staged versions live in ``config.stage_dir/<server_name>/v<version>/``; only the current and
    the staged version are kept, and the next stage reuses the current one's weights file. ``version`` is
    the version the engine serves at start.
    """

    def __init__(self, config: CheckpointConfig, model_dir: Path, engine: WeightEngine, engine_url: str,
                 server_name: str, host: str = "127.0.0.1", port: int = 0, version: int = 0,
                 metrics: CheckpointMetrics | None = None, adapter_name: str = "policy",
                 on_adapter: Callable[[str | None], None] | None = None,
                 on_commit: Callable[[int], None] | None = None, stage_port: int = 0):
        self.config = config
        self.host = host
        self.port = port
        self.stage_port = stage_port  # the port a Stage's data comes on; 0: any free one (told in Status)
        self.metrics = metrics or CheckpointMetrics()
        stage_root = Path(config.stage_dir) / server_name
        shutil.rmtree(stage_root, ignore_errors=True)
        self.service = CheckpointService(config, model_dir, stage_root, engine, engine_url, version, self.metrics,
                                         server_id=server_name, adapter_name=adapter_name, on_adapter=on_adapter,
                                         on_commit=on_commit)
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def version(self) -> int:
        """The policy version the engine serves (for the registry heartbeat)."""
        return self.service.current_version

    async def start(self) -> str:
        """Serve and return ``host:port`` (to publish): port 0 takes any free port, a busy fixed one is
        retried for a bounded time (``bind_retrying``; the wait blocks this loop, which serves nothing yet).
        The stage port listens on the same host."""
        # Without SO_REUSEPORT (on by default in gRPC) a second receiver on a busy port fails instead of sharing it.
        options = [*GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
        credentials = server_credentials(self.config)
        client_name = self.config.tls_client_name if credentials is not None else None
        interceptor = CallerInterceptor(self.config.token.get_secret_value(), client_name, self.metrics)
        server = grpc.aio.server(interceptors=[interceptor], options=options)
        server.add_generic_rpc_handlers((self.service.handlers(),))
        self.port = bind_retrying(partial(self._add_port, server, credentials), "checkpoint receiver", self.host,
                                  self.port)
        self.service.address = self.address
        stage_port = StagePort(self.host, self.stage_port, ssl_context(self.config, server_side=True),
                               self.config.connect_timeout_s, self.metrics.refused, self.service.server_id)
        self.stage_port, self.service.stage_port = stage_port.port, stage_port
        await server.start()
        self._server = server
        return self.address

    def _add_port(self, server: grpc.aio.Server, credentials: grpc.ServerCredentials | None, port: int) -> int:
        try:
            if credentials is not None:
                return server.add_secure_port(f"{self.host}:{port}", credentials)
            return server.add_insecure_port(f"{self.host}:{port}")
        except RuntimeError:
            # gRPC only says "Failed to bind"; a plain bind raises EADDRINUSE (retried) if the port is busy.
            listen_socket(self.host, port, "checkpoint receiver", timeout_s=0).close()
            raise

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving and delete this server's staging area (the served model dir is never touched)."""
        self.service.close()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self.service.stage_port is not None:
            await asyncio.to_thread(self.service.stage_port.close)
            self.service.stage_port = None
        shutil.rmtree(self.service.stage_root, ignore_errors=True)


class ReceiverThread:
    """The receiver on an event loop of its own, in a thread.

    The rollout worker's event loop is busy with dozens of episodes (templates, tool calls, replies); a
    Commit awaiting its engine calls there would be delayed by that work and stretch the pause. Here the
    pause is the engine's swap time alone. ``start()`` returns the address to register.
    """

    def __init__(self, config: CheckpointConfig, model_dir: Path, engine_urls: list[str], server_name: str,
                 host: str, port: int, metrics: CheckpointMetrics, timeout_s: float = 600.0,
                 engine_api_key: str | None = None, adapter_name: str = "policy",
                 on_adapter: Callable[[str | None], None] | None = None,
                 on_commit: Callable[[int], None] | None = None, stage_port: int = 0):
        self._make = lambda engine: CheckpointReceiver(
            config, model_dir, engine, engine_urls[0], server_name, host=host, port=port, metrics=metrics,
            adapter_name=adapter_name, on_adapter=on_adapter, on_commit=on_commit, stage_port=stage_port,
        )
        self._name = server_name
        self._urls = engine_urls
        self._timeout_s = timeout_s
        self._engine_api_key = engine_api_key
        self._ready: Future[str] = Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="checkpoint-receiver",
                                        daemon=True)

    def start(self, timeout_s: float = 60.0) -> str:
        self._thread.start()
        try:
            return self._ready.result(timeout_s)
        except TimeoutError:
            raise TimeoutError(f"checkpoint receiver of {self._name}: not serving within {timeout_s:g} s (binding "
                               "its gRPC and stage ports)") from None

    async def _main(self) -> None:
        engines = [EngineClient(url, timeout_s=self._timeout_s, api_key=self._engine_api_key) for url in self._urls]
        receiver = self._make(EngineGroup(engines))
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            try:
                self._ready.set_result(await receiver.start())
            except BaseException as exc:  # handed to start()'s caller
                self._ready.set_exception(exc)
                raise
            await self._stop.wait()
        finally:
            await receiver.stop()
            for engine in engines:
                await engine.aclose()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
