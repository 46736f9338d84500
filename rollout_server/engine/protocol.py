"""SGLang's native API bodies: the ``/generate`` contract gate and normalisation, and the control bodies.

Errors come in SGLang 0.5.23's three shapes (see docs/engine.md): ``ContractError`` (the schema gate,
``{"error": "<string>"}``), ``ValueError`` (``{"error": {"message": ...}}``), and pydantic validation of
control bodies (``{"object": "error", ...}``, produced by the server's handler).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import replace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import PreTrainedTokenizerBase

from core.config import check_sampling
from rollout_server.engine.request import Request
from rollout_server.engine.sampling import SamplingParams

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # the seeds torch.Generator.manual_seed takes


class ContractError(ValueError):
    """The body breaks the schema of ``/generate`` (SGLang's ``api_contract`` gate)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SamplingParamsBody(_Strict):
    """Every key SGLang's ``SamplingParams`` takes; the ones marked unsupported must keep their default."""

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None  # unsupported
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0  # unsupported
    presence_penalty: float = 0.0  # unsupported
    repetition_penalty: float = 1.0  # unsupported
    min_new_tokens: int = 0  # unsupported
    n: int = 1  # unsupported
    json_schema: str | None = None  # unsupported
    regex: str | None = None  # unsupported
    ebnf: str | None = None  # unsupported
    structural_tag: str | None = None  # unsupported
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None  # unsupported
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None  # unsupported
    sampling_seed: int | None = None


_UNSUPPORTED = (
    "stop_regex",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "custom_params",
    "logit_bias",
)


# top-level fields of SGLang's ``GenerateReqInput`` that change the prompt, the sampling or the reply there: set
# (anything truthy), they are refused rather than ignored, which would hand a client other tokens or a reply without
# what it asked for without a word; the fields that only route, label or log a request are ignored, as unknown ones
_UNHONOURED_TOP = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "positional_embed_overrides",
    "session_params",
    "custom_logit_processor",
    "max_thinking_tokens",
    "require_reasoning",
    "return_hidden_states",
    "return_routed_experts",
    "return_indexer_topk",
    "return_entropy",
    "return_sampling_mask",
)


class GenerateBody(BaseModel):
    """The top-level ``/generate`` fields this engine reads; other keys are ignored, as in SGLang."""

    model_config = ConfigDict(strict=True, extra="ignore")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the adapter's name (one per prompt in a batch)


class GenerateSpec:
    """What ``build_requests`` needs to know about the served model."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, max_context: int, eos_ids: frozenset[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.eos_ids = eos_ids


def build_requests(body: Any, spec: GenerateSpec) -> tuple[list[Request], bool]:
    """Validate and normalise a ``/generate`` body; returns the requests and whether it was a batch."""
    gen = _gate(body)
    unhonoured = next((k for k in _UNHONOURED_TOP if _any(body.get(k), bool)), None)
    if unhonoured is not None:
        raise ValueError(f"{unhonoured} is not supported by the embedded engine")
    if gen.stream:
        raise ValueError("stream=true is not supported by the embedded engine")
    if gen.token_ids_logprob is not None or _any(gen.top_logprobs_num, lambda v: v not in (None, 0)):
        raise ValueError("top_logprobs_num and token_ids_logprob are not supported by the embedded engine")
    if _any(gen.logprob_start_len, lambda v: v not in (None, -1)):
        raise ValueError("logprob_start_len >= 0 (input logprobs) is not supported by the embedded engine")
    prompts, batch = _prompts(gen, spec)
    n = len(prompts)
    params = _per_item(gen.sampling_params, n, "sampling_params")
    rids = _rids(gen.rid, n, batch)
    logprob = _per_item(gen.return_logprob, n, "return_logprob")
    loras = _per_item(gen.lora_path, n, "lora_path")
    reqs = [
        _request(prompt, _sampling(p or {}), rid, bool(lp), gen, spec, lora)
        for prompt, p, rid, lp, lora in zip(prompts, params, rids, logprob, loras, strict=True)
    ]
    return reqs, batch


def _gate(body: Any) -> GenerateBody:
    if not isinstance(body, dict):
        raise ContractError(f"invalid type: expected a JSON object, got {type(body).__name__}")
    try:
        gen = GenerateBody.model_validate(body)
    except ValidationError as exc:
        raise ContractError(_first_error(exc)) from None
    items = gen.sampling_params if isinstance(gen.sampling_params, list) else [gen.sampling_params or {}]
    for item in items:
        unknown = sorted(set(item) - set(SamplingParamsBody.model_fields))
        if unknown:
            expected = ", ".join(f"`{k}`" for k in SamplingParamsBody.model_fields)
            raise ContractError(f"sampling_params: unknown field `{unknown[0]}`, expected one of {expected}")
        try:
            SamplingParamsBody.model_validate(item)
        except ValidationError as exc:
            raise ContractError(_first_error(exc, "sampling_params")) from None
    return gen


def _first_error(exc: ValidationError, prefix: str = "") -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    return f"{loc}: {err['msg']} (got {err.get('input')!r})"


def _any(value: Any, pred: Any) -> bool:
    return any(pred(v) for v in (value if isinstance(value, list) else [value]))


def _prompts(gen: GenerateBody, spec: GenerateSpec) -> tuple[list[list[int]], bool]:
    if gen.input_ids is not None:
        ids = gen.input_ids
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
    elif gen.text is not None:
        batch = isinstance(gen.text, list)
        texts = gen.text if batch else [gen.text]
        prompts = [spec.tokenizer.encode(t) for t in texts]  # the tokenizer's special tokens, as SGLang encodes text
    else:
        raise ValueError("Either text or input_ids should be provided.")
    field = "input_ids" if gen.input_ids is not None else "text"
    if not prompts:
        raise ValueError(f"{field} is an empty batch")
    for i, prompt in enumerate(prompts):
        where = f"{field}[{i}]" if batch else field
        if not prompt:
            raise ValueError(f"{where} is empty")
        bad = next((t for t in prompt if not 0 <= t < spec.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where} has token id {bad}, outside the vocabulary [0, {spec.vocab_size})")
    return prompts, batch


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} items for a batch of {n}")
    return value


def _rids(rid: str | list[str] | None, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, list):
        return _per_item(rid, n, "rid")
    return [f"{rid}_{i}" for i in range(n)] if batch else [rid]


def _sampling(raw: dict[str, Any]) -> SamplingParams:
    body = SamplingParamsBody.model_validate(raw)
    for key in _UNSUPPORTED:
        if getattr(body, key) != SamplingParamsBody.model_fields[key].default:
            raise ValueError(f"sampling_params.{key} is not supported by the embedded engine")
    if not math.isfinite(body.temperature):  # JSON as Python reads it has Infinity and NaN; SGLang's verify refuses
        raise ValueError(f"sampling_params.temperature must be a finite number, got {body.temperature}")
    check_sampling(body.temperature, body.top_p, body.top_k, body.min_p, where="sampling_params.")
    if body.sampling_seed is not None and not SEED_MIN <= body.sampling_seed <= SEED_MAX:
        raise ValueError(f"sampling_params.sampling_seed must be in [{SEED_MIN}, {SEED_MAX}] (a torch.Generator's "
                         f"seed), got {body.sampling_seed}")
    if body.max_new_tokens is not None and body.max_new_tokens < 0:
        raise ValueError(f"sampling_params.max_new_tokens must be >= 0, got {body.max_new_tokens}")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stop) > 32:
        raise ValueError(f"sampling_params.stop has {len(stop)} strings, at most 32 are allowed")
    return SamplingParams(
        max_new_tokens=-1 if body.max_new_tokens is None else body.max_new_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        stop=tuple(s for s in stop if s),
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        no_stop_trim=body.no_stop_trim,
        sampling_seed=body.sampling_seed,
    )


def _request(
    prompt: list[int], params: SamplingParams, rid: str, logprob: bool, gen: GenerateBody, spec: GenerateSpec,
    lora: str | None = None,
) -> Request:
    if len(prompt) >= spec.max_context:  # SGLang's check, whatever max_new_tokens says
        raise ValueError(
            f"The input ({len(prompt)} tokens) is longer than the model's context length ({spec.max_context} tokens)."
        )
    if params.max_new_tokens < 0:  # None: up to the context length
        params = replace(params, max_new_tokens=spec.max_context - len(prompt))
    total = len(prompt) + params.max_new_tokens
    if total > spec.max_context:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {spec.max_context} tokens. "
            f"You requested a total of {total} tokens: {len(prompt)} tokens from the input messages and "
            f"{params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit."
        )
    stop_ids = frozenset() if params.ignore_eos else params.stop_token_ids | spec.eos_ids  # SGLang ignores both
    gen_seed = None if params.sampling_seed is None else torch.Generator().manual_seed(params.sampling_seed)
    return Request(
        rid=rid,
        input_ids=list(prompt),
        params=params,
        return_logprob=logprob,
        stop_ids=stop_ids,
        stop_window=max((len(s.encode()) for s in params.stop), default=0) + 1,
        return_text_in_logprobs=gen.return_text_in_logprobs,
        return_prompt_token_ids=gen.return_prompt_token_ids,
        generator=gen_seed,
        lora=lora,
    )


# ---- control endpoints (SGLang ``io_struct``; unknown keys are ignored) ----------------------------


class PauseGenerationReq(BaseModel):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReq(BaseModel):
    torch_empty_cache: bool = True


class MemoryOccupationReq(BaseModel):
    """SGLang's ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``: None or [] is all tags."""

    tags: list[str] | None = None


class UpdateWeightsFromDiskReq(BaseModel):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    keep_pause: bool = False
    is_async: bool = False
    token_step: int = 0


class PrepareWeightsFromDiskReq(BaseModel):
    """rollwave's own route (SGLang has none): read ``model_path`` ahead of its ``update_weights_from_disk``;
    ``prefill_running``: also compute the KV of the requests running now under it, for the load that retracts
    them (``Scheduler.prefill_ahead``)."""

    model_path: str
    prefill_running: bool = False


class UpdateWeightsFromTensorReq(BaseModel):
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


class WeightUpdateSessionReq(BaseModel):
    selector: str = "all"


class AbortReq(BaseModel):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightVersionReq(BaseModel):
    new_version: str
    abort_all_requests: bool = True


class LoadLoRAAdapterReq(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoRAAdapterReq(BaseModel):
    lora_name: str = Field(min_length=1)
