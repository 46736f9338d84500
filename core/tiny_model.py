"""The tiny Qwen2 model that tests and ``make demo`` train: built deterministically here, never downloaded.

The shape is the one that learned tool use by RL on a 2-core CPU: Qwen2, hidden 128, 2 layers,
4 heads / 2 KV heads, MLP 512, tied embeddings, fp32, ~0.58M parameters. The tokenizer is a byte-level
BPE with one token per digit (numbers are copied digit by digit) trained on the project's own task text:
capped at 1000 entries, it stops at ~680 when every word of that text is one token. It depends on no
seed, so models of every seed share token ids. The chat template is the Qwen2.5 tool-calling format,
shortened to fit the small context.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import AddedToken, pre_tokenizers, trainers
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

from core.tasks import arith

RECIPE = 1  # bump when anything below changes what a build writes
MARKER = "rollwave_tiny_model.json"
VOCAB_SIZE = 1000
MAX_CONTEXT = 1024
PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
_CORPUS_SEED = 0
_CORPUS_TASKS = 2000

# Qwen2.5's tool format: schemas in the system turn inside <tools></tools>; calls as <tool_call> JSON;
# tool results as a user turn of <tool_response> blocks, consecutive tool messages merged into one turn.
CHAT_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + ((tool.function if tool.function is defined else tool) | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\nTo call a function, reply:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set fn = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
            {%- if fn.arguments is string %}
                {{- fn.arguments }}
            {%- else %}
                {{- fn.arguments | tojson }}
            {%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
""".strip()


def _qwen2_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Qwen2Tokenizer:
    """Qwen2's own class: transformers 5 rebuilds a qwen2 model's tokenizer from vocab + merges with this
    class's normalizer and pre-tokenizer whatever tokenizer.json says, so we train under exactly those."""
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_CONTEXT,
        clean_up_tokenization_spaces=False,
    )


def _corpus(renderer: Qwen2Tokenizer) -> list[str]:
    """Rendered arith demonstration chats, cut at the control tokens (those are added tokens, not BPE)."""
    rng = random.Random(_CORPUS_SEED)
    chats = [
        arith.demonstration(task, rng, wrong_formula_rate=0.5)
        for task in arith.generate("train", limit=_CORPUS_TASKS, seed=_CORPUS_SEED)
    ]
    texts = renderer.apply_chat_template(chats, tools=[arith.CALCULATOR_SCHEMA], tokenize=False)
    texts += renderer.apply_chat_template([chat[:2] for chat in chats[:100]], tokenize=False)
    control = re.compile("|".join(re.escape(t) for t in (PAD, IM_START, EOS, *TOOL_TOKENS)))
    return [piece for text in texts for piece in control.split(text) if piece]


def build_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE (vocab <= 1000) under Qwen2's pre-tokenizer, which isolates every digit.

    Deterministic and seed-free: the corpus is fixed, and the tokenizers BPE trainer breaks ties by id.
    """
    base = _qwen2_tokenizer({PAD: 0, IM_START: 1, EOS: 2}, [])
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        special_tokens=[PAD, IM_START, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend = base.backend_tokenizer
    backend.train_from_iterator(_corpus(base), trainer)
    bpe = json.loads(backend.to_str())["model"]
    tokenizer = _qwen2_tokenizer(bpe["vocab"], [tuple(m) for m in bpe["merges"]])
    tokenizer.add_tokens([AddedToken(IM_START, special=True, normalized=False)], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tokenizer


def build_model(tokenizer: Qwen2Tokenizer, seed: int) -> Qwen2ForCausalLM:
    """The tiny shape above, initialised from ``seed`` only: normal(0, 0.02) weights, 0 biases, unit norms."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        dtype="float32",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    return model.eval()


def save_random_qwen2(out_dir: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                      max_positions: int = 1024) -> int:
    """A Qwen2 of this shape (random init from seed 0, fp32, tied embeddings) with the tiny model's tokenizer, saved
    to ``out_dir``: the larger models benches and GPU tests need. Returns its parameter count."""
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True, dtype="float32",
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MARKER
    }


def _built(directory: Path, seed: int) -> bool:
    """True if ``directory`` holds an intact build of this recipe and seed; an error if it holds another."""
    marker = directory / MARKER
    if not directory.is_dir() or not any(directory.iterdir()):
        return False
    if not marker.is_file():
        raise ValueError(f"{directory} is not empty and holds no tiny model (no {MARKER}); not touching it")
    record = json.loads(marker.read_text())
    if (record.get("recipe"), record.get("seed")) != (RECIPE, seed):
        raise ValueError(
            f"{directory} holds a tiny model of recipe {record.get('recipe')} seed {record.get('seed')}, "
            f"not recipe {RECIPE} seed {seed}; remove it or choose another directory"
        )
    if record.get("files") != _digests(directory):
        raise ValueError(f"{directory}: files differ from the checksums in {MARKER}; remove it and rebuild")
    return True


def build_tiny_model(out_dir: Path, seed: int = 0) -> Path:
    """Build the tiny model and tokenizer into ``out_dir`` (HF format) and return it.

    An intact build of the same recipe and seed is returned as is. The build is written to a temporary
    sibling and renamed into place, so ``out_dir`` is either absent/empty or complete, never half written.
    """
    out_dir = Path(out_dir)
    if _built(out_dir, seed):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tokenizer = build_tokenizer()
        build_model(tokenizer, seed).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a model directory is shared read-only
        for file in tmp.iterdir():
            file.chmod(0o644)
        record = {"recipe": RECIPE, "seed": seed, "files": _digests(tmp)}
        (tmp / MARKER).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        try:
            tmp.rename(out_dir)  # atomic; replaces an empty directory
        except OSError:
            if not _built(out_dir, seed):  # a concurrent build finished first; it must be ours too
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def cli_init(args: argparse.Namespace) -> int:
    """``rollwave model init --out DIR [--seed N]``; a ValueError (exit 2) if DIR holds something else."""
    out = build_tiny_model(Path(args.out), seed=args.seed)
    model = Qwen2ForCausalLM.from_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny model (seed {args.seed}) in {out}: {params:,} parameters, vocab {model.config.vocab_size}")
    return 0
