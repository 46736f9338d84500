"""One generation request inside the engine: its tokens, behaviour logprobs, weight versions and end.

The scheduler thread owns a ``Request`` while it runs; the HTTP side awaits ``future`` and then turns the
finished request into SGLang's reply (``reply``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout_server.engine.prefix_cache import Prefix
from rollout_server.engine.sampling import SamplingParams


def abort_reason(started: bool) -> dict[str, Any]:
    """SGLang's finish reason for an aborted request, running (``started``) or still queued."""
    if started:
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return {"type": "abort", "message": "Abort in waiting queue"}


@dataclass(eq=False)
class Request:
    """A request from admission to its finish reason (SGLang ``Req``)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    stop_ids: frozenset[int]
    # tokens to decode when looking for stop strings: their longest in UTF-8 bytes, plus one (every token adds a
    # byte or more, and a character outside ASCII may take one token per byte)
    stop_window: int
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    generator: torch.Generator | None = None
    lora: str | None = None  # the adapter it names (SGLang's lora_path); None: the base model
    created: float = field(default_factory=time.monotonic)  # for its age (e2e_latency, the admission wait)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    num_retractions: int = 0
    cached_tokens: int = 0  # of its last prefill, taken from the prefix cache
    kv_epoch: int = -1  # the scheduler's load count at its last prefill; -1: its KV is never cached
    extends: Prefix | None = None  # the prefix cache's entry its last prefill started from
    finish_reason: dict[str, Any] | None = None
    finish_version: str | None = None
    failure: Exception | None = None  # set when it fails: its waiter gets this error, not a reply
    batch: tuple[Request, ...] = ()  # the requests of its /generate call: when one fails, the others are aborted
    future: Future = field(default_factory=Future)

    @property
    def tokens(self) -> list[int]:
        """Prompt and output so far: what a (re-)prefill runs through the model."""
        return self.input_ids + self.output_ids

    def append(self, token: int, logprob: float, version: str, tokenizer: Any) -> bool:
        """Record a sampled token; returns True when the request is finished."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        n = len(self.output_ids)
        if self.spans and self.spans[-1]["version"] == version:
            self.spans[-1]["end"] = n
        else:
            self.spans.append({"version": version, "start": n - 1, "end": n})
        # SGLang's order (Req.check_finished): the length first, so an end token that is the last one allowed
        # finishes as length; then the stop tokens (none under ignore_eos), then the stop strings
        if n >= self.params.max_new_tokens:
            self.finish_reason = {"type": "length", "length": self.params.max_new_tokens}
        elif token in self.stop_ids:
            self.finish_reason = {"type": "stop", "matched": token}
        elif self.params.stop and (matched := self._stop_string(tokenizer)) is not None:
            self.finish_reason = {"type": "stop", "matched": matched}
        return self.finish_reason is not None

    def _stop_string(self, tokenizer: Any) -> str | None:
        tail = tokenizer.decode(self.output_ids[-self.stop_window :])
        return next((s for s in self.params.stop if s in tail), None)

    def finish(self, reason: dict[str, Any] | None, version: str) -> None:
        """End the request (``reason`` None keeps the one ``append`` set) and wake its waiter."""
        if reason is not None:
            self.finish_reason = reason
        self.finish_version = version
        if not self.future.done():
            self.future.set_result(self)

    def reply(self, tokenizer: Any) -> dict[str, Any]:
        """SGLang's non-streaming ``/generate`` item (``tokenizer_manager._handle_batch_output``)."""
        reason = self.finish_reason
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": reason}
        if reason["type"] == "abort" and not self.output_ids:
            meta.update(weight_version=self.finish_version, completion_tokens=0, e2e_latency=self._latency())
            return {"text": "", "output_ids": [], "meta_info": meta}
        text_ids = self.output_ids
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not self.params.no_stop_trim:
            text_ids = text_ids[:-1]
        text = tokenizer.decode(text_ids, skip_special_tokens=self.params.skip_special_tokens)
        if isinstance(reason.get("matched"), str) and not self.params.no_stop_trim:
            pos = text.find(reason["matched"])
            text = text[:pos] if pos != -1 else text
        meta.update(
            prompt_tokens=len(self.input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens,
            reasoning_tokens=0,
            num_retractions=self.num_retractions,
            weight_version=self.finish_version,
            weight_versions=[dict(s) for s in self.spans],
        )
        if self.return_logprob:
            texts = [tokenizer.decode([t]) if self.return_text_in_logprobs else None for t in self.output_ids]
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                [lp, t, s] for lp, t, s in zip(self.logprobs, self.output_ids, texts, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(self.output_ids)
        meta["e2e_latency"] = self._latency()
        meta["response_sent_to_client_ts"] = time.time()
        out: dict[str, Any] = {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}
        if self.return_prompt_token_ids:
            out["prompt_token_ids"] = list(self.input_ids)
        return out

    def _latency(self) -> float:
        return time.monotonic() - self.created
