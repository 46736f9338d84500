"""Continuous batching: one thread owns the model and runs admit -> prefill -> decode -> retire forever.

Each iteration admits waiting requests (a left-padded prefill, then they join the running batch),
decodes every running request by one token in a single forward over the shared KV cache, and retires
the finished ones, so no request waits for another to complete. The HTTP side never touches the model:
it submits requests and runs commands (pause, abort, weight loads) on this thread between steps.

Pause modes (SGLang's ``/pause_generation``): ``abort`` ends every request in flight with its partial
output; ``retract`` moves running requests back to the queue and drops their KV, so after continue they
are prefilled again from prompt + output under whatever weights are loaded then (every token's logprob is
then exactly the policy recorded for it in ``weight_versions``); ``in_place`` keeps the batch and its KV as
they are, as SGLang does: after a weight load the running requests go on from KV the old weights computed,
with no re-prefill, so the swap stalls them less and their next tokens are sampled from new weights over an
old prefix (the logprobs returned are still the ones sampled from).

Memory (``rollout_server.engine.memory``): a paused engine can release its weights and KV for a colocated
trainer and resume them later; it will not continue until the weights are loaded again in full.

The generation stall of a pause (``rollwave_engine_generation_stall_seconds``) runs from the last token
sampled before it to the first sampled after it, so it includes waiting for the pause, the load, the
continue and any re-prefill; a pause with nothing running stalls nothing and is not observed.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollout_server.engine.kv import KVBatch
from rollout_server.engine.lora import Adapter, AdapterSet
from rollout_server.engine.memory import ModelMemory, PreparedWeights
from rollout_server.engine.metrics import EngineMetrics
from rollout_server.engine.prefix_cache import Hit, Layers, PrefixCache, common_length, past_length, shared_prefixes
from rollout_server.engine.request import Request, abort_reason
from rollout_server.engine.sampling import BatchSampler
from rollout_server.engine.tree_prefill import tree_prefill
from rollout_server.engine.weights import WeightError, load_into

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
SHARED_PREFIX_MIN_TOKENS = 16  # a row gains from a shared prefix only if it has this many more of it than cached
SHARED_PREFIX_MIN_SAVED = 1024  # a prefill's shared prefixes get a forward of their own if it saves this many tokens


class EngineFailure(RuntimeError):
    """A model step failed; the requests it was running end with this error."""

    finish = "error"  # the failed requests' label in rollwave_engine_requests_total


class NonFiniteLogits(EngineFailure):
    """SGLang's "NaN happened": a request's next-token logits were not finite (a diverged policy, weights holding
    NaN), so no token can be sampled and no logprob returned. That request alone fails, its call answered 500 naming
    it; SGLang instead ends it as stopped, with a stop token for the one it could not sample."""

    finish = "nan"


@dataclass
class _AheadJob:
    """A ``prefill_ahead`` in progress: the requests whose KV is still to compute under ``prepared``; once they
    are done, one more sweep takes the requests admitted since."""

    prepared: PreparedWeights
    requests: deque[Request]
    done: Future
    seen: set[Request] = field(default_factory=set)  # every request queued in the job
    tokens: int = 0
    swept: bool = False


class Scheduler:
    """The engine's model, tokenizer, request queues and the thread that steps them."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model_path: str,
        weight_version: str = "default",
        max_batch_size: int = 64,
        max_context: int = 1024,
        prefill_tokens: int = 8192,
        prefix_cache_tokens: int = 16384,
        admit_wait_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.adapters = AdapterSet(model)
        self.memory = ModelMemory(model)
        self.released: set[str] = set()  # memory tags released and not resumed
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = model_path
        self.version = weight_version
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.prefill_tokens = prefill_tokens
        self.admit_wait_s = admit_wait_s
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.shared_prefix_min_saved = SHARED_PREFIX_MIN_SAVED
        self._kv_epoch = 0  # counts loads: a request prefilled before the last one holds KV of older weights
        self.metrics = EngineMetrics()
        self.metrics.set_version(weight_version)
        self.paused: PauseMode | None = None
        self._shared_gen = torch.Generator().manual_seed(seed)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._rid_lock = threading.Lock()
        self._rids: set[str] = set()
        self._waiting: deque[Request] = deque()
        self._gated: list[Request] = []  # arrived while a weight update waits for in-flight requests
        self._barriers: deque[tuple[Callable[[], Any], Future]] = deque()
        self._running: list[Request] = []
        self._admitting: list[Request] = []  # popped from the queue, being prefilled
        self._orphans: set[Request] = set()  # of calls a request of which failed: aborted after the step
        self._batch: KVBatch | None = None
        self._pending: torch.Tensor | None = None  # last sampled token per running row, not yet in the KV
        self._sampler: BatchSampler | None = None
        self._paused_at = 0.0
        self._last_token_at = 0.0  # when the last step sampled tokens
        self._stalled_since: float | None = None  # a pause stopped running requests at this time
        self._ahead: _AheadJob | None = None  # a prefill_ahead in progress
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self.metrics.memory_bytes.labels(kind="weights").set_function(self.memory.weight_bytes)
        self.metrics.memory_bytes.labels(kind="kv_cache").set_function(self._kv_bytes)
        self.metrics.memory_bytes.labels(kind="spare_weights").set_function(self.memory.spare_bytes)

    # ---- called from other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; requests still in flight end as aborted."""
        if self._thread.is_alive():
            self.call(self._stop).result()
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, reqs: list[Request]) -> None:
        """Queue requests; raises ValueError (nothing queued) if a rid is already in flight."""
        rids = [r.rid for r in reqs]
        with self._rid_lock:
            if len(set(rids)) != len(rids) or self._rids.intersection(rids):
                raise ValueError("Duplicate request ID detected")
            self._rids.update(rids)
        for r in reqs:
            r.batch = tuple(reqs)
        self._inbox.put(lambda: self._enqueue(reqs))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread between two steps (not at all if its caller gave up first)."""
        fut: Future = Future()
        self._inbox.put(lambda: _settle(fut, fn))
        return fut

    def call_when_idle(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` once the requests in flight have finished, or at once while paused.

        Requests that arrive meanwhile wait until ``fn`` has run: SGLang's weight-update writer lock.
        """
        fut: Future = Future()
        self._inbox.put(lambda: self._barriers.append((fn, fut)))
        return fut

    def prefill_ahead(self, prepared: PreparedWeights | None) -> Future:
        """Compute, under ``prepared``, the KV of the requests running now, then of those admitted meanwhile (the
        base model's), one prefill chunk between decode steps, for the load that swaps it in to put in the prefix
        cache: a request that load's pause retracts then prefills only what it generated since, so
        ``kv_on_swap: recompute`` leaves the re-prefill out of the stall. Resolves with the tokens computed: 0
        without a prefix cache or requests running; a load of ``prepared``, or its replacement, ends the job with
        what is done."""
        fut: Future = Future()
        self._inbox.put(lambda: self._start_ahead(prepared, fut))
        return fut

    # ---- commands (scheduler thread) -----------------------------------------------------------

    def pause(self, mode: PauseMode) -> None:
        if self.paused is None:
            self._paused_at = time.monotonic()
            if self._running and mode != "abort":
                self._stalled_since = self._last_token_at
        self.paused = mode
        if mode == "abort":
            self.abort(None)
        elif mode == "retract":
            self._retract()

    def resume(self) -> None:
        if self.paused is None:
            return
        reasons = [f"memory {sorted(self.released)} is released"] if self.released else []
        if self.memory.needs_load and "weights" not in self.released:
            missing = self.memory.missing()
            reasons.append(f"the weights of {len(missing)} parameters (first {missing[0]!r}) were not loaded "
                           "since resume_memory_occupation: update the weights first")
        if reasons:
            self._refuse("continue_generation", "; ".join(reasons))
        if not (self._running or self._waiting):  # what the pause stopped was aborted meanwhile
            self._stalled_since = None
        self.metrics.paused_seconds.inc(time.monotonic() - self._paused_at)
        self.paused = None

    def abort(self, rid: str | None) -> int:
        """Abort requests whose rid starts with ``rid`` (all when None), as SGLang's scheduler matches."""
        return self.abort_where(lambda r: rid is None or r.rid.startswith(rid))

    def abort_where(self, hit: Callable[[Request], bool]) -> int:
        """Abort the requests in flight for which ``hit`` is true; returns how many."""
        count = 0
        for q in (self._waiting, self._gated):
            for r in [r for r in q if hit(r)]:
                q.remove(r)
                self._finish(r, abort_reason(started=bool(r.output_ids)))
                count += 1
        rows = [i for i, r in enumerate(self._running) if hit(r)]
        self._retire(rows, abort_reason(started=True))
        return count + len(rows)

    def load_weights(
        self,
        tensors: dict[str, torch.Tensor] | PreparedWeights,
        *,
        require_all: bool,
        model_path: str | None,
        version: str | None,
        flush_cache: bool = True,
    ) -> None:
        """Copy checked tensors into the model, or swap prepared ones in (raises WeightError, keeping the old
        weights). Without ``flush_cache`` (SGLang's flag) the prefix cache and the KV of the requests running
        stay usable for later turns, though the old weights computed them."""
        start = time.monotonic()
        if self.memory.released:
            self.metrics.refused.labels(call="update_weights").inc()
            reason = "the weights are released: resume_memory_occupation with tag 'weights' first"
            log.warning("update_weights refused: %s", reason)
            raise WeightError(reason)
        ahead: list[tuple[list[int], Layers]] = []
        if isinstance(tensors, PreparedWeights):
            if self._ahead is not None and self._ahead.prepared is tensors:
                self._end_ahead()
            self.memory.swap_in(tensors)
            ahead = tensors.ahead
        else:
            load_into(self.model, tensors, require_all=require_all)
            self.memory.loaded(set(tensors))
        if flush_cache:
            self._new_kv_epoch()
            for tokens, layers in ahead:  # computed under these weights: the retracted requests start from it
                self.prefix_cache.insert(tokens, None, layers)
        if model_path is not None:
            self.model_path = model_path
        if version is not None:
            self.set_version(version)
        self.metrics.weight_update_seconds.observe(time.monotonic() - start)

    def install_adapter(self, name: str, adapter: Adapter) -> None:
        """Serve ``adapter`` as ``name`` (replacing one of that name). Only KV that adapter computed is stale:
        the base model's and other adapters' stay in the prefix cache."""
        self.adapters.install(name, adapter)
        self._forget_adapter_kv(name)

    def remove_adapter(self, name: str) -> int:
        """Stop serving ``name``; requests still naming it are aborted. Returns how many."""
        if name not in self.adapters.loaded:
            return 0
        aborted = self.abort_where(lambda r: r.lora == name)
        self.adapters.remove(name)
        self._forget_adapter_kv(name)
        return aborted

    def release_memory(self, tags: tuple[str, ...]) -> None:
        """Free the memory of ``tags`` (see ``rollout_server.engine.memory``); only while paused or idle, as
        SGLang asserts. An idle engine is paused by it, so requests that arrive queue until continue, which is
        refused until the memory is back. Releasing ``kv_cache`` retracts requests an ``in_place`` pause kept."""
        if self.paused is None:
            if not self.idle():
                self._refuse("release_memory_occupation",
                             f"{self.in_flight()} requests in flight: pause_generation first")
            self.pause("retract")
        if "kv_cache" in tags and self._running:
            self._retract()
        if "weights" in tags:
            self.memory.release()
        self._new_kv_epoch()
        self.released.update(tags)
        log.info("released memory %s", sorted(tags))

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        """Allocate the memory of ``tags`` again; resumed weights hold garbage until the next full load."""
        if "weights" in tags:
            self.memory.resume()
        self.released.difference_update(tags)
        log.info("resumed memory %s", sorted(tags))

    def _refuse(self, call: str, reason: str) -> None:
        """Log and count a refused control call, and raise ValueError with the reason."""
        self.metrics.refused.labels(call=call).inc()
        log.warning("%s refused: %s", call, reason)
        raise ValueError(f"{call}: {reason}")

    def _kv_bytes(self) -> int:
        batch = self._batch
        return self.prefix_cache.nbytes + (0 if batch is None else batch.nbytes)

    def _forget_adapter_kv(self, name: str) -> None:
        """Adapter ``name`` changed: its cached KV leaves, and its running requests' KV is never cached."""
        self.prefix_cache.drop_adapter(name)
        for r in self._running:
            if r.lora == name:
                r.kv_epoch = -1

    def _new_kv_epoch(self) -> None:
        """The weights changed (or the memory went): no KV computed so far is kept or reused."""
        self._kv_epoch += 1
        self.prefix_cache.clear()

    def set_version(self, version: str) -> None:
        self.version = version
        self.metrics.set_version(version)

    def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache``: empty the prefix cache; refused (False) while requests are in flight."""
        if not self.idle():
            return False
        self.prefix_cache.clear()
        return True

    def idle(self) -> bool:
        """No request running or queued (queued ones do not count while paused, as in SGLang)."""
        return not self._running and (self.paused is not None or not (self._waiting or self._gated))

    def in_flight(self) -> int:
        return len(self._running) + len(self._waiting) + len(self._gated)

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._closed:
                busy = bool(self._barriers) or (
                    self.paused is None and bool(self._running or self._waiting or self._ahead))
                self._drain(block=not busy)
                self._run_barriers()
                if self.paused is None and not self._closed:
                    try:
                        self._admit()
                        if self._running:
                            self._decode()
                    except Exception as exc:  # a failed forward fails its requests loudly, the engine lives on
                        log.exception("engine step failed")
                        self.metrics.step_failures.inc()
                        self._fail_running(exc)
                    self._abort_orphans()
                    if self._ahead is not None:
                        self._ahead_step()
                self.metrics.running.set(len(self._running))
                self.metrics.waiting.set(len(self._waiting) + len(self._gated))
                self.metrics.pending_updates.set(len(self._barriers))

    def _drain(self, block: bool) -> None:
        if block:
            self._inbox.get()()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _enqueue(self, reqs: list[Request]) -> None:
        for r in reqs:
            if not r.future.set_running_or_notify_cancel():  # its handler was cancelled: nobody waits for it
                with self._rid_lock:
                    self._rids.discard(r.rid)
            elif r.params.max_new_tokens == 0:  # nothing to sample (this engine computes no input logprobs)
                self._finish(r, {"type": "length", "length": 0})
            elif r.lora is not None and r.lora not in self.adapters.loaded:  # unloaded since the route checked
                self._finish(r, {"type": "abort", "message": f"LoRA adapter {r.lora!r} is not loaded"})
            else:
                (self._gated if self._barriers else self._waiting).append(r)

    def _run_barriers(self) -> None:
        if not self._barriers or (self.paused is None and (self._running or self._waiting)):
            return
        while self._barriers:
            fn, fut = self._barriers.popleft()
            _settle(fut, fn)
        self._waiting.extend(self._gated)
        self._gated.clear()

    def _admit(self) -> None:
        """Prefill waiting requests into the running batch; while it decodes, newcomers wait up to
        ``admit_wait_s`` for company (each prefill forward holds every running request up), unless they would
        fill the batch."""
        free = self.max_batch_size - len(self._running)
        if self._running and len(self._waiting) < free and self._waiting \
                and time.monotonic() - self._waiting[0].created < self.admit_wait_s:
            return
        while free > 0 and self._waiting:
            chunk: list[Request] = []
            width = 0
            while self._waiting and len(chunk) < free:
                w = max(width, len(self._waiting[0].tokens))
                if chunk and w * (len(chunk) + 1) > self.prefill_tokens:
                    break
                chunk.append(self._waiting.popleft())
                width = w
            free -= len(chunk)
            self._admitting = chunk
            self._prefill(chunk)
            self._admitting = []

    def _prefill(self, chunk: list[Request]) -> None:
        """Prefill ``chunk``: each distinct sequence once (a group's samples share their prompt), from the
        longest prefix the cache holds for it or that it shares with others in the chunk (``_prefill_kv``)."""
        rows: dict[tuple[str | None, tuple[int, ...]], int] = {}
        index = [rows.setdefault((r.lora, tuple(r.tokens)), len(rows)) for r in chunk]
        distinct = list({row: r for row, r in zip(index, chunk, strict=True)}.values())
        batch, logits, reused, hits = self._prefill_kv([(r.lora, r.tokens) for r in distinct], index)
        for r, row in zip(chunk, index, strict=True):
            hit = hits[row]
            r.kv_epoch, r.cached_tokens = self._kv_epoch, reused[row]
            r.extends = hit.entry if hit is not None and hit.extends else None
        # every copy counts as if prefilled alone (prompt = cached + shared + computed): a copy of a sequence
        # earlier in the chunk (a group's first turn) takes what the cache holds of it, the rest it shares
        cached = [0 if h is None else min(n, h.tokens, len(r.tokens) - 1)
                  for n, h, r in zip(reused, hits, distinct, strict=True)]
        first = {row: i for i, row in reversed(list(enumerate(index)))}
        self.metrics.prompt_tokens.inc(sum(len(r.tokens) for r in chunk))
        self.metrics.cached_tokens.inc(sum(cached[row] for row in index))
        self.metrics.shared_tokens.inc(sum(len(r.tokens) - cached[row] for i, (r, row) in
                                           enumerate(zip(chunk, index, strict=True)) if first[row] != i))
        tokens, logprobs = self._make_sampler(chunk).sample(logits)
        if self._batch is None:
            self._batch, self._pending, self._running = batch, tokens, list(chunk)
        else:
            self._batch.merge(batch)
            self._pending = torch.cat([self._pending, tokens])
            self._running.extend(chunk)
        self._sampler = None
        offset = len(self._running) - len(chunk)
        self._retire([offset + i for i in self._record(chunk, tokens, logprobs)])

    def _prefill_kv(
        self, seqs: list[tuple[str | None, list[int]]], rows: list[int] | None = None
    ) -> tuple[KVBatch, torch.Tensor, list[int], list[Hit | None]]:
        """Run (adapter, tokens) ``seqs`` through the model: the batch and the next-token logits of ``rows``
        (indices into ``seqs``; default: each once, in order), and for each of ``seqs`` how many of its tokens
        came from earlier KV and what the prefix cache held of it.

        A row starts from what the cache holds of it (the longest entry it extends, or the whole blocks it shares
        with another), or from a prefix it shares with other rows
        (``shared_prefixes``), computed first and once (recursively: those prefixes may share one too) where
        that saves at least ``shared_prefix_min_saved`` tokens: a forward of its own is not free, so a system
        prompt that two episodes share is not worth one, a swap's retracted groups are. The rows run in two
        forwards where one would run the short uncached rests of later turns as wide as new prompts
        (``_split``)."""
        hits = [self.prefix_cache.lookup(tokens, lora) for lora, tokens in seqs]
        past: list[Layers | None] = [None if h is None else h.entry.head(min(h.tokens, len(tokens) - 1))
                                     for h, (_, tokens) in zip(hits, seqs, strict=True)]
        # no prefix can save more than every row but one running the longest whole: small prefills skip the search
        bound = (len(seqs) - 1) * max(len(tokens) for _, tokens in seqs)
        prefixes = [] if bound < self.shared_prefix_min_saved else shared_prefixes(
            seqs, [past_length(p) for p in past], SHARED_PREFIX_MIN_TOKENS)
        if prefixes and sum(n * (len(sharing) - 1) for n, sharing in prefixes) >= self.shared_prefix_min_saved:
            heads, _, _, _ = self._prefill_kv([(seqs[sharing[0]][0], seqs[sharing[0]][1][:n])
                                               for n, sharing in prefixes])
            for at, (n, sharing) in enumerate(prefixes):
                for i in sharing:
                    past[i] = heads.row(at)
                self.metrics.shared_tokens.inc(n * (len(sharing) - 1))
        rests = [len(tokens) - past_length(p) for p, (_, tokens) in zip(past, seqs, strict=True)]
        parts = _split(sorted(range(len(seqs)), key=rests.__getitem__), rests)
        reused = [0] * len(seqs)
        batch = logits = None
        for part in parts:
            self.adapters.rows = [seqs[i][0] for i in part]
            b, lg, used = KVBatch.prefill(self.model, [seqs[i][1] for i in part], [past[i] for i in part])
            for i, n in zip(part, used, strict=True):
                reused[i] = n
            if batch is None:
                batch, logits = b, lg
            else:
                batch.merge(b)
                logits = torch.cat([logits, lg])
        position = {row: at for at, row in enumerate(row for part in parts for row in part)}
        wanted = [position[row] for row in (range(len(seqs)) if rows is None else rows)]
        if wanted != list(range(len(wanted))):  # duplicates, or rows reordered by the split
            batch.keep(wanted)
            logits = logits[wanted]
        return batch, logits, reused, hits

    def _start_ahead(self, prepared: PreparedWeights | None, fut: Future) -> None:
        self._end_ahead()  # a newer prepare replaces the one in progress
        if not fut.set_running_or_notify_cancel():  # its caller gave up
            return
        requests = _by_tokens(r for r in self._running if r.lora is None)
        if prepared is None or not self.prefix_cache.max_tokens or not requests:
            fut.set_result(0)
            return
        self._ahead = _AheadJob(prepared, requests, fut, seen=set(requests))

    def _ahead_step(self) -> None:
        """One chunk of the ahead job under its prepared weights: requests, taken in token order, while their
        distinct tokens (those not shared with the request before) stay within ``prefill_tokens``."""
        job = self._ahead
        assert job is not None
        chunk: list[Request] = []
        seqs: list[list[int]] = []
        distinct = 0
        while self.memory.holds(job.prepared) and job.requests:
            tokens = job.requests[0].tokens
            own = len(tokens) - (common_length(seqs[-1], tokens) if seqs else 0)
            if chunk and distinct + own > self.prefill_tokens:
                break
            r = job.requests.popleft()
            if r.finish_reason is None:
                chunk.append(r)
                seqs.append(tokens)
                distinct += own
        if chunk:
            try:  # the cache holds the old weights' KV: every token is computed, each distinct one once
                with self.memory.serving(job.prepared):
                    self.adapters.rows = []  # base rows only (requests with an adapter are not computed ahead)
                    layers, computed = tree_prefill(self.model, seqs)
            except Exception as exc:  # the swap will re-prefill them: only the job fails
                log.exception("computing the KV of running requests ahead of a load failed")
                self._ahead = None
                job.done.set_exception(exc)
                return
            job.prepared.ahead += list(zip(seqs, layers, strict=True))
            job.tokens += sum(map(len, seqs))
            self.metrics.ahead_tokens.inc(sum(map(len, seqs)))
            self.metrics.shared_tokens.inc(sum(map(len, seqs)) - computed)
        if not job.requests and not job.swept:
            job.swept = True
            job.requests.extend(_by_tokens(r for r in self._running if r.lora is None and r not in job.seen))
        if not job.requests or not self.memory.holds(job.prepared):
            self._end_ahead()

    def _end_ahead(self) -> None:
        job, self._ahead = self._ahead, None
        if job is not None:
            job.done.set_result(job.tokens)

    def _decode(self) -> None:
        start = time.monotonic()
        if self._sampler is None:
            self._sampler = self._make_sampler(self._running)
        self.adapters.rows = [r.lora for r in self._running]
        logits = self._batch.decode(self.model, self._pending)
        tokens, logprobs = self._sampler.sample(logits)
        self._pending = tokens
        self.metrics.decode_step_seconds.observe(time.monotonic() - start)
        self._retire(self._record(self._running, tokens, logprobs))

    def _record(self, reqs: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor) -> list[int]:
        """Append each row's token; returns the indices of the requests that finished. A row whose sampled logprob
        is not finite (its logits hold a NaN or an infinity, which ``log_softmax`` spreads over the whole row)
        appends nothing: that request finishes failed (``NonFiniteLogits``)."""
        version, tok = self.version, self.tokenizer
        done = []
        for i, (r, t, lp) in enumerate(zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True)):
            if not math.isfinite(lp):
                r.failure = NonFiniteLogits(
                    f"NaN happened: the logits of request {r.rid!r} are not finite (NaN or infinite) at output token "
                    f"{len(r.output_ids)}, under weight version {version!r}: the policy diverged or its weights hold "
                    "NaN")
                log.error("%s", r.failure)
                done.append(i)
            elif r.append(t, lp, version, tok):
                done.append(i)
        self.metrics.generated_tokens.inc(len(reqs) - sum(r.failure is not None for r in reqs))
        self._last_token_at = time.monotonic()
        if self._stalled_since is not None:
            self.metrics.generation_stall_seconds.observe(self._last_token_at - self._stalled_since)
            self._stalled_since = None
        return done

    def _retire(self, rows: list[int], reason: dict[str, Any] | None = None) -> None:
        """Finish the running requests at ``rows`` and drop them from the batch."""
        if not rows:
            return
        gone = set(rows)
        for i in rows:
            r = self._running[i]
            if r.failure is not None:  # its KV is never cached
                self._fail([r], r.failure)
                continue
            if r.kv_epoch == self._kv_epoch and self.prefix_cache.max_tokens:
                n = int(self._batch.lengths[i])
                self.prefix_cache.insert(r.tokens[:n], r.lora, self._batch.row(i), replaces=r.extends)
            self._finish(r, reason)
        kept = len(self._running) - len(gone)
        last = iter(i for i in range(kept, len(self._running)) if i not in gone)
        keep = [next(last) if i in gone else i for i in range(kept)]  # the last rows fill the places left: no copy
        self._running = [self._running[i] for i in keep]
        if keep:
            self._batch.keep(keep)
            self._pending = self._pending[keep]
        else:
            self._batch = self._pending = None
        self._sampler = None

    def _retract(self) -> None:
        for r in self._running:
            r.num_retractions += 1
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._batch = self._pending = self._sampler = None

    def _finish(self, req: Request, reason: dict[str, Any] | None) -> None:
        req.finish(reason, self.version)
        with self._rid_lock:
            self._rids.discard(req.rid)
        self.metrics.requests.labels(finish=req.finish_reason["type"]).inc()

    def _fail_running(self, exc: Exception) -> None:
        admitting = [r for r in self._admitting if r not in self._running]
        self._fail(self._running + admitting, EngineFailure(f"{type(exc).__name__}: {exc}"))
        self._running, self._admitting = [], []
        self._batch = self._pending = self._sampler = None

    def _fail(self, reqs: list[Request], exc: EngineFailure) -> None:
        """End ``reqs`` with ``exc`` for their waiters (their calls answer 500 with it), counted by ``exc.finish``.
        The other requests of their calls are aborted after the step (``_abort_orphans``)."""
        for r in reqs:
            with self._rid_lock:
                self._rids.discard(r.rid)
            if not r.future.done():
                r.future.set_exception(exc)
            self.metrics.requests.labels(finish=exc.finish).inc()
            self._orphans.update(r.batch)

    def _abort_orphans(self) -> None:
        """Abort what is left of calls that failed (queued, or running in a later chunk): their reply is already
        an error, so nobody waits for them, and they would hold batch slots and KV until they finished."""
        if not self._orphans:
            return
        orphans, self._orphans = self._orphans, set()
        count = self.abort_where(orphans.__contains__)
        if count:
            log.warning("aborted %d requests whose /generate call failed", count)

    def _make_sampler(self, reqs: list[Request]) -> BatchSampler:
        return BatchSampler([r.params for r in reqs], [r.generator for r in reqs], self._shared_gen)

    def _stop(self) -> None:
        self._closed = True
        self.paused = None
        self.abort(None)
        self._end_ahead()
        for fn, fut in self._barriers:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"engine closed before {fn!r} ran"))
        self._barriers.clear()


def _settle(fut: Future, fn: Callable[[], Any]) -> None:
    """Run ``fn`` for ``fut``'s waiter and hand it the result or the error, unless the waiter cancelled ``fut``
    first (its HTTP handler was cancelled): then ``fn`` does not run, and the scheduler thread never sets a
    cancelled future (``InvalidStateError`` would end the thread)."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn()
    except Exception as exc:  # handed to the caller through the future
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _by_tokens(requests: Iterable[Request]) -> deque[Request]:
    """``requests`` in the order of their tokens, each next to those it shares most with."""
    return deque(sorted(requests, key=lambda r: r.tokens))


def _split(order: list[int], rests: list[int]) -> list[list[int]]:
    """Rows (``order``: by uncached rest, shortest first) in one prefill forward, or in two where that at least
    halves the columns run: a forward runs every row as wide as its longest rest."""
    n, widest = len(order), rests[order[-1]]
    cost, at = min((k * rests[order[k - 1]] + (n - k) * widest, k) for k in range(1, n + 1))
    return [order[:at], order[at:]] if at < n and 2 * cost <= n * widest else [order]
