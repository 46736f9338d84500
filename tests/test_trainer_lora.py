"""LoRA on the trainer (``model.lora``): a DCP checkpoint resumes the adapter and its optimizer exactly, the HF
export writes a peft adapter (and the merged model on request) that computes what the trainer computed, and
dropout acts in the training forward only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from trainer_helpers import synthetic_groups
from transformers import AutoModelForCausalLM, PhiConfig, PhiForCausalLM

from core.config import ConfigError, LoraConfig, TrainerConfig
from core.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer.checkpoint import export_hf
from trainer.lora import adapter_config_json, add_adapter, iter_adapter_params
from trainer.parallel import DistContext
from trainer.worker import Trainer

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
CFG = {"total_steps": 3, "checkpoint_every": 2, "lr": 1e-2, "device": "cpu"}



def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in iter_adapter_params(trainer.model) if t is not None}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_resume_restores_adapter_and_optimizer_and_export_computes_the_same(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trainer = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path / "run", lora=LORA).start(ctx=ctx)
    for seed in range(2):
        trainer.train(synthetic_groups(seed, 3))  # the second step writes checkpoint 2
    saved = _adapter(trainer)
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    assert len(moments) == len(saved)  # the optimizer holds the adapter alone
    last = trainer.train(synthetic_groups(2, 3))
    ids = torch.tensor([list(range(5, 25))])
    trained = _logits(trainer.model, ids)
    trainer.close()

    resumed = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path / "run", lora=LORA).start(resume=True, ctx=ctx)
    assert resumed.step == 3  # the final step was checkpointed too
    again = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path / "run2", lora=LORA).start(ctx=ctx)
    step2 = tmp_path / "run" / "checkpoints" / "step_00000002"
    again.checkpointer.load(step2, again.model, again.optimizer, again.scheduler)
    for name, tensor in _adapter(again).items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    for key, state in again.optimizer.state_dict()["state"].items():
        torch.testing.assert_close(state["exp_avg"], moments[key], rtol=0, atol=0)
    redo = again.train(synthetic_groups(2, 3))
    assert redo["loss"] == pytest.approx(last["loss"], rel=1e-6)
    torch.testing.assert_close(_logits(resumed.model, ids), trained, rtol=1e-5, atol=1e-5)
    for t in (resumed, again):
        t.close()

    checkpoint = resumed.checkpointer.latest()
    adapter_dir = export_hf(checkpoint, tiny_model_dir, tmp_path / "adapter", LORA)
    assert {p.name for p in adapter_dir.iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert not (adapter_dir / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    torch.testing.assert_close(_logits(loaded, ids), trained, rtol=1e-5, atol=1e-5)
    merged_dir = export_hf(checkpoint, tiny_model_dir, tmp_path / "merged", LORA, merge=True)
    assert (merged_dir / "adapter" / ADAPTER_WEIGHTS).is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    torch.testing.assert_close(_logits(merged, ids), trained, rtol=1e-4, atol=1e-4)


def test_dropout_acts_in_the_training_forward_only(tiny_model_dir: Path) -> None:
    ids = torch.tensor([list(range(5, 25))])
    model = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        LORA.model_copy(update={"dropout": 0.5})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)
    no_dropout = add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LORA).eval()
    no_dropout.load_state_dict(model.state_dict())
    expected = _logits(no_dropout, ids)
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=0)  # no grad: no dropout
    with torch.enable_grad():
        first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.allclose(first, expected) and not torch.allclose(first, second)


def test_dropout_leaves_the_proximal_policy_the_served_one_with_one_update(ctx: DistContext, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """With adapter dropout and one update per step (``ppo_minibatches=1``) π_prox is still the adapter without
    dropout, the function the engines serve: on-policy behaviour logprobs (a no-grad forward of the trainer's own
    weights) give IS weights of exactly 1 and no logprob gap, while the training forward keeps its dropout (u =
    π_θ/π_prox moves off 1, so the clip acts). The dropout forward's own logprobs as π_prox gave a gap of 0.16."""
    cfg = TrainerConfig(**{**CFG, "loss": "ppo"})
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, lora=LORA.model_copy(update={"dropout": 0.5})).start(ctx=ctx)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if ".lora_B." in name:
                param.to_local().copy_(torch.randn(param.to_local().shape, generator=gen) * 0.5)  # B = 0 adds nothing
    groups = synthetic_groups(0, 3)
    for s in (s for g in groups for s in g.samples):
        ids = torch.as_tensor(s.token_ids, dtype=torch.long)[None]
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, :-1].float()
        forced = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].numpy()
        s.behaviour_logprobs = np.r_[0.0, np.where(s.loss_mask[1:] > 0, forced, 0.0)].astype(np.float32)
    record = trainer.train(groups)
    trainer.close()
    assert record["logprob_gap"] < 1e-5
    assert abs(record["is_ratio_mean"] - 1) < 1e-5 and abs(record["is_ratio_max"] - 1) < 1e-5
    assert record["clip_fraction"] > 0.0


def _lora_layers(model: torch.nn.Module) -> list[peft.tuners.lora.Linear]:
    return [m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear)]


def test_rank_and_alpha_set_the_adapter_shapes_and_its_scale(tiny_model_dir: Path) -> None:
    """model.lora.rank is the inner dimension of every A and B, and alpha / rank the factor B @ A is scaled by: the
    same A and B (rank 4) under alpha 32 move q_proj's output 4 times as far as under alpha 8. peft's defaults
    (rank 8, alpha 8: scale 1) or ours (rank 8, alpha 16: scale 2) give other shapes and another scale; the
    adapter config pushed to the engines carries both."""
    lora = LoraConfig(rank=4, alpha=32, target_modules=["q_proj"])
    models = {alpha: add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                 lora.model_copy(update={"alpha": alpha})).eval() for alpha in (32.0, 8.0)}
    with torch.no_grad():
        for name, param in models[32.0].named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.5)  # a fresh B is 0: the adapter would add nothing
    models[8.0].load_state_dict(models[32.0].state_dict())
    layers = {alpha: _lora_layers(model) for alpha, model in models.items()}
    assert len(layers[32.0]) == 2  # q_proj of each of the 2 layers
    for layer in layers[32.0]:
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert a.shape == (4, layer.in_features) and b.shape == (layer.out_features, 4)
        assert layer.scaling["default"] == 8.0
    assert [layer.scaling["default"] for layer in layers[8.0]] == [2.0, 2.0]
    x = torch.randn(3, layers[32.0][0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        deltas = {alpha: ls[0](x) - ls[0].base_layer(x) for alpha, ls in layers.items()}
    assert deltas[8.0].abs().max() > 1e-3
    torch.testing.assert_close(deltas[32.0], 4 * deltas[8.0], rtol=1e-4, atol=1e-6)
    config = json.loads(adapter_config_json(models[32.0]))
    assert (config["r"], config["lora_alpha"]) == (4, 32.0)


def test_the_base_models_own_dropout_stays_off_as_in_a_full_weight_run() -> None:
    """Only the adapter's dropout acts in the training forward. A base model with dropout layers of its own (Phi's
    resid_pdrop, embd_pdrop) runs them off under LoRA as it does without (the trainer runs it in eval): the grad
    forward computes what the engines serve. Hooking every nn.Dropout of the model turned Phi's on in the grad
    forward, with has_dropout() False, so π_prox was taken from a forward with dropout."""
    config = PhiConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       resid_pdrop=0.5, embd_pdrop=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = add_adapter(PhiForCausalLM(config), LORA.model_copy(update={"target_modules": ["q_proj"]})).eval()
    ids = torch.tensor([list(range(5, 25))])
    torch.testing.assert_close(model(input_ids=ids).logits, _logits(model, ids), rtol=0, atol=0)


def test_a_target_module_the_engines_cannot_serve_is_refused_naming_the_key(tiny_model_dir: Path) -> None:
    """The engines add an adapter to Linear modules only: an adapter on the embedding (peft's lora_embedding_A/B)
    trained and then failed every push at the engine's load. It is refused when the adapter is added (the trainer's
    start), naming model.lora.target_modules and the module."""
    lora = LORA.model_copy(update={"target_modules": ["q_proj", "embed_tokens"]})
    needle = r"model\.lora\.target_modules: 'model\.embed_tokens' \(Embedding\) is not a Linear"
    with pytest.raises(ConfigError, match=needle):
        add_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
