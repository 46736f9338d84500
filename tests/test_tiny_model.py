"""The tiny model: deterministic builds, loadable by the Auto classes, Qwen2.5 tool chat template."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.config import ConfigError, load_config
from core.model_dir import ensure_model
from core.tasks.arith import CALCULATOR_SCHEMA, demonstration, generate
from core.tiny_model import MARKER, build_tiny_model
from services.cli import main

ROOT = Path(__file__).resolve().parents[1]

ECHO_SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    reference = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == reference
    assert (other / "model.safetensors").read_bytes() != reference
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        # the tokenizer is seed-free, so models of every seed share token ids
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes()
        assert (other / name).read_bytes() == (tiny_model_dir / name).read_bytes()


def test_model_seed_picks_the_weights_ensure_model_builds(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``model.seed`` is the seed of the tiny model a run builds (``init_if_missing``): the same seed gives the same
    weights in another directory, and they differ from the default seed's (the session model, seed 0)."""
    built = [
        ensure_model(load_config(None, [f"model.path={tmp_path / name}", "model.init_if_missing=true",
                                        "model.seed=7"], env={}).model)
        for name in ("a", "b")
    ]
    weights = [(d / "model.safetensors").read_bytes() for d in built]
    assert weights[0] == weights[1] != (tiny_model_dir / "model.safetensors").read_bytes()
    assert json.loads((built[0] / MARKER).read_text())["seed"] == 7


def test_existing_build_is_reused_and_foreign_dirs_are_refused(tmp_path: Path) -> None:
    out = build_tiny_model(tmp_path / "m", seed=2)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(out, seed=2) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="seed 2, not recipe 1 seed 3"):
        build_tiny_model(out, seed=3)

    (out / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="differ from the checksums"):
        build_tiny_model(out, seed=2)

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"no {MARKER}"):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_auto_classes_load_the_architecture_and_a_forward_pass_works(tiny_model_dir: Path, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.tie_word_embeddings) == (512, 1024, True)
    assert cfg.vocab_size == len(tokenizer) and 500 <= cfg.vocab_size <= 1000
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert cfg.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id
    assert cfg.pad_token_id == tokenizer.convert_tokens_to_ids("<|endoftext|>") == tokenizer.pad_token_id

    ids = tokenizer("A farm has 12 cows.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_loaded_tokenizer_is_the_saved_one(tiny_model_dir: Path, tokenizer) -> None:
    # transformers rebuilds a qwen2 tokenizer's pre-tokenizer from its class: it must be what we trained
    saved = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == saved


def test_digits_are_one_token_each(tokenizer) -> None:
    for text in ("1234567890", "x 9081 and (12+345)*6", "The answer is 100200."):
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
        digits = [t for t in tokens if any(c.isdigit() for c in t)]
        assert all(len(t) == 1 for t in digits), tokens
        assert len(digits) == sum(c.isdigit() for c in text)
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_control_tokens_are_single_ids_and_tool_tags_survive_decoding(tokenizer) -> None:
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|><tool_response></tool_response>"
    ids = tokenizer(text)["input_ids"]
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert tokenizer.convert_tokens_to_ids(token) in ids
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call><tool_response></tool_response>"


def test_chat_template_renders_qwen25_tool_format(tokenizer) -> None:
    task = generate("test", limit=1)[0]
    chat = demonstration(task, random.Random(0), wrong_formula_rate=0.0)
    expression = task.meta["expression"]
    answer = task.reward["ground_truth"]
    text = tokenizer.apply_chat_template(chat, tools=[CALCULATOR_SCHEMA], tokenize=False)
    system = task.messages[0]["content"]
    schema = json.dumps(CALCULATOR_SCHEMA["function"], ensure_ascii=False)
    assert text == (
        f"<|im_start|>system\n{system}\n\n# Tools\n<tools>\n{schema}\n</tools>\n"
        "To call a function, reply:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n{task.messages[1]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        f'{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {answer}.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        task.messages, tools=[CALCULATOR_SCHEMA], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)

    tools = [CALCULATOR_SCHEMA]
    full_ids = tokenizer.apply_chat_template(chat, tools=tools)["input_ids"]
    prompt_ids = tokenizer.apply_chat_template(task.messages, tools=tools, add_generation_prompt=True)[
        "input_ids"
    ]
    assert full_ids[: len(prompt_ids)] == prompt_ids
    assert full_ids == tokenizer(text)["input_ids"]


def test_consecutive_tool_results_merge_into_one_user_turn(tokenizer) -> None:
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1+2"}'}},
        {"type": "function", "function": {"name": "echo", "arguments": {"text": "hi"}}},
    ]
    chat = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": calls},
        {"role": "tool", "name": "calculator", "content": "3"},
        {"role": "tool", "name": "echo", "content": "hi"},
    ]
    text = tokenizer.apply_chat_template(
        chat, tools=[CALCULATOR_SCHEMA, ECHO_SCHEMA], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n")
    assert '\n{"name": "echo", "description": "Echo a text."' in text
    assert text.endswith(
        "<|im_start|>assistant\nTwo calls.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\nhi\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_prompts_fit_the_small_context(tokenizer) -> None:
    for task in generate("test", limit=20):
        one = tokenizer.apply_chat_template(
            task.messages, tools=[CALCULATOR_SCHEMA], add_generation_prompt=True
        )
        two = tokenizer.apply_chat_template(
            task.messages, tools=[CALCULATOR_SCHEMA, ECHO_SCHEMA], add_generation_prompt=True
        )
        assert len(one["input_ids"]) < 180 and len(two["input_ids"]) < 230


def test_cli_init_reports_where_and_how_big(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["model", "init", "--out", str(out), "--seed", "4"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "parameters" in printed
    assert main(["model", "init", "--out", str(out), "--seed", "5"]) == 2
    assert "seed 4" in capsys.readouterr().err


def test_a_model_path_without_a_tokenizer_is_a_config_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((tiny_model_dir / name).read_bytes())
    with pytest.raises(ConfigError, match=rf"^model.path: {tmp_path} has no tokenizer \(none of tokenizer.json"):
        ensure_model(load_config(None, [f"model.path={tmp_path}"], env={}).model)


def test_checking_a_model_that_is_there_imports_no_torch(tiny_model_dir: Path) -> None:
    """A rollout server and ``rollwave up`` check their model directory at start; the builder's torch and
    transformers (seconds of every start) are imported only to build the tiny model."""
    check = ("import sys; from core.config import load_config; from core.model_dir import ensure_model; "
             f"ensure_model(load_config(None, ['model.path={tiny_model_dir}'], env={{}}).model); "
             "import services.ray_launcher; print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.strip() == "[]", out
