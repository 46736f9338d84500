"""Token-in/token-out trajectories: what the policy generated, exactly, and the template tokens around it.

The prompt is rendered once with the chat template. Every assistant turn appends the engine's
``output_ids`` unchanged (loss_mask 1), so generated text is never re-tokenised. A tool turn is
rendered through the chat template *against a fixed dummy prefix* (verl/slime): its tokens are
``ids(dummy + tool_msgs, add_generation_prompt=True)[len(ids(dummy)):]``, which never depends on how
the template would re-render the model's own turn. What the template writes after an assistant
turn's end token (Qwen: the ``\\n`` after ``<|im_end|>``) is appended too, with loss_mask 0.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_DUMMY = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]
RENDERS_KEPT = 1024  # the most recent renders a ChatRenderer keeps (each a few hundred token ids)


@dataclass
class Turn:
    """One /generate reply as the trajectory needs it: the contract between the agent loop and the builder.

    ``output_ids``, ``logprobs`` and ``versions`` have one entry per generated token; ``approximate``: the
    versions are the one current when the request started, not the engine's own per-token spans.
    """

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    approximate: bool = False


class ChatRenderer:
    """Token ids from a tokenizer's chat template: the prompt, and tool turns as template deltas.

    Renders are kept (the last ``RENDERS_KEPT``, keyed by the messages' and tools' JSON, key order included):
    the n samples of an agent group each open their episode with the same request, and a render (jinja, then
    the tokenizer) costs milliseconds of the rollout server's event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_id: int = tokenizer.eos_token_id
        self._rendered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._dummy_ids = self._ids(_DUMMY, add_generation_prompt=False)
        ends = [i for i, t in enumerate(self._dummy_ids) if t == self.eos_id]
        if not ends:
            raise ValueError("chat template: an assistant turn does not end with the eos token")
        self.turn_end_suffix: list[int] = self._dummy_ids[ends[-1] + 1 :]

    def _ids(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any = None
    ) -> list[int]:
        try:
            key = json.dumps([messages, tools, add_generation_prompt])
        except (TypeError, ValueError):  # not JSON data: rendered every time
            key = None
        ids = self._rendered.get(key) if key is not None else None
        if ids is None:
            ids = tuple(self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            ))
            if key is not None:
                self._rendered[key] = ids
                while len(self._rendered) > RENDERS_KEPT:
                    self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(key)
        return list(ids)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self._ids(messages, add_generation_prompt=True, tools=tools or None)

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """Tokens of the tool turn and the next assistant header (Qwen: ``<|im_start|>user ...
        <|im_end|>\\n<|im_start|>assistant\\n``), all template tokens."""
        full = self._ids(_DUMMY + tool_messages, add_generation_prompt=True)
        n = len(self._dummy_ids)
        if full[:n] != self._dummy_ids:
            raise ValueError("chat template: rendering tool messages changed the tokens of earlier turns")
        return full[n:]

    def assistant_turn_ids(self, message: dict[str, Any]) -> list[int]:
        """Tokens the policy emits for an assistant message, through its end token (for SFT demonstrations):
        the template's rendering after the assistant header, cut after the eos."""
        head = self._ids(_DUMMY[:1], add_generation_prompt=True)
        full = self._ids(_DUMMY[:1] + [message], add_generation_prompt=False)
        if full[: len(head)] != head:
            raise ValueError("chat template: rendering an assistant turn changed the tokens before it")
        body = full[len(head) :]
        if self.eos_id not in body:
            raise ValueError("chat template: an assistant turn does not end with the eos token")
        return body[: body.index(self.eos_id) + 1]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class TrajectoryBuilder:
    """The growing token sequence of one episode with its per-token loss mask, logprobs and versions."""

    prompt_ids: list[int]
    token_ids: list[int] = field(init=False)
    loss_mask: list[int] = field(init=False)
    logprobs: list[float] = field(init=False)
    versions: list[int] = field(init=False)
    versions_approximate: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        self.token_ids = list(self.prompt_ids)
        self.loss_mask = [0] * n
        self.logprobs = [0.0] * n
        self.versions = [-1] * n

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_generated(self, turn: Turn) -> None:
        n = len(turn.output_ids)
        assert len(turn.logprobs) == n and len(turn.versions) == n, "turn arrays differ in length"
        self.token_ids += turn.output_ids
        self.loss_mask += [1] * n
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.versions_approximate |= turn.approximate

    def add_template(self, ids: list[int]) -> None:
        """Tokens the policy did not generate (tool output, template markup): loss_mask 0."""
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def arrays(self) -> dict[str, np.ndarray]:
        """The ``Sample`` fields, in the schema's dtypes."""
        return {
            "token_ids": np.asarray(self.token_ids, dtype=np.int32),
            "loss_mask": np.asarray(self.loss_mask, dtype=np.uint8),
            "behaviour_logprobs": np.asarray(self.logprobs, dtype=np.float32),
            "token_versions": np.asarray(self.versions, dtype=np.int32),
        }


def model_stop_ids(tokenizer: Any) -> frozenset[int]:
    """The ids an engine serving the tokenizer's model stops on, as SGLang and the embedded engine read them: the
    tokenizer's eos and the eos ids of the model's config and generation config beside it (Qwen: ``<|endoftext|>``
    as well as ``<|im_end|>``). The tokenizer's eos alone where those files cannot be read."""
    from transformers import AutoConfig, GenerationConfig

    ids = {tokenizer.eos_token_id}
    for load in (AutoConfig.from_pretrained, GenerationConfig.from_pretrained):
        try:
            eos = load(tokenizer.name_or_path, local_files_only=True).eos_token_id  # never a download
        except (OSError, ValueError):
            continue
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def masked_spans(loss_mask: list[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of equal mask values as ``(start, end, value)``, end exclusive (for printing and tests)."""
    spans: list[tuple[int, int, int]] = []
    start = 0
    values = [int(v) for v in loss_mask]
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            spans.append((start, i, values[start]))
            start = i
    return spans
