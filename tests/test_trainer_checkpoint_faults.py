"""What the trainer does with what it reads from disk when that is wrong, and with a checkpoint it cannot write.

A checkpoint whose files are not the ones written (a shard missing, cut short or with other bytes, DCP's index gone,
the state file cut) is refused naming the file and the way out, never loaded as other numbers; a model directory
whose weights do not fit its config.json is refused naming the tensor, never trained from random numbers where a
tensor is missing; a checkpoint of another critic is refused like one of another policy; a save that cannot write
names the checkpoint and leaves the last complete one the resume point. Refusals of what cannot change by starting
again exit 2 (``python -m trainer``), which no launcher restarts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_helpers import synthetic_groups

from core.config import ConfigError, TrainerConfig
from trainer.checkpoint import FORMAT, STATE_FILE, CheckpointMismatch, export_hf
from trainer.parallel import DistContext, iter_full_params
from trainer.worker import Trainer

ROOT = Path(__file__).resolve().parents[1]
CFG = {"total_steps": 8, "checkpoint_every": 1, "keep_checkpoints": 2, "lr": 1e-2, "micro_batch_tokens": 128,
       "device": "cpu"}
LACKED = "model.layers.1.mlp.down_proj.weight"


def _trained(ctx: DistContext, model: Path, run_dir: Path, steps: int, **cfg: object) -> Trainer:
    """A trainer of ``run_dir`` that trained ``steps`` steps, a checkpoint after each."""
    trainer = Trainer(TrainerConfig(**{**CFG, **cfg}), model, run_dir).start(ctx=ctx)
    for _ in range(steps):
        trainer.train(synthetic_groups(trainer.step, 2))
    return trainer


def _model_copy(model: Path, out: Path, config: dict[str, object] | None = None, lack: str | None = None) -> Path:
    """A copy of the tiny model at ``out`` with ``config`` set in its config.json and the tensor ``lack`` left out
    of its weights."""
    shutil.copytree(model, out)
    if config is not None:
        (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), **config}))
    if lack is not None:
        weights = load_file(out / "model.safetensors")
        del weights[lack]
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1  # within a tensor's bytes: no header to trip over
    file.write_bytes(bytes(data))


def _cut_in_half(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_way_out(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A resume (and an export) refuses, as exit 2 does, rather than load a shard's flipped bit as another weight, or
    fail on a cut one, a missing index or a cut state file without naming it. The way out names the checkpoint
    before it, whose later groups were acked: no resume falls back to it by itself."""
    trainer = _trained(ctx, tiny_model_dir, tmp_path / "run", steps=2)
    root = trainer.checkpointer.root
    latest = root / "step_00000002"
    pristine = shutil.copytree(latest, tmp_path / "pristine")
    way_out = re.escape(f": checkpoint step_00000002 is damaged: restore it from a copy, or move it out of {root} to "
                        "resume from step_00000001 (the groups trained since were acked: they are not trained again); "
                        "an export can take another checkpoint (--checkpoint DIR)")
    for name, damage, problem in (
        ("__0_0.distcp", _flip_a_byte, r"its bytes differ from those written \(CRC-32\)"),
        ("__0_0.distcp", _cut_in_half, r"\d+ bytes, \d+ were written"),
        (".metadata", Path.unlink, "missing"),
        ("rng_rank0.pt", _cut_in_half, r"\d+ bytes, \d+ were written"),
        (STATE_FILE, _cut_in_half, r"[^:]+: line \d+ column \d+ \(char \d+\)"),
    ):
        damage(latest / name)
        file = re.escape(str(latest / name))
        with pytest.raises(CheckpointMismatch, match=rf"^{file}: {problem}{way_out}$"):
            trainer.restore(latest)
        if damage is _flip_a_byte:  # named otherwise (relative, through ..): the way out still names the one before
            named = Path(os.path.relpath(root / ".." / "checkpoints" / latest.name))
            with pytest.raises(CheckpointMismatch, match=rf"^.*{problem}: checkpoint step_00000002 .*to resume from "
                                                         r"step_00000001 .*; an export can take another checkpoint"):
                export_hf(named, tiny_model_dir, tmp_path / "hf")
            assert not (tmp_path / "hf").exists()
        shutil.rmtree(latest)
        shutil.copytree(pristine, latest)
    assert trainer.restore(latest) and trainer.step == 2

    # written before the state file recorded its files: DCP's own errors, named, and an Exception (CheckpointException
    # is a BaseException, which the trainer's crash record let through)
    record = json.loads((latest / STATE_FILE).read_text())
    del record["files"]
    (latest / STATE_FILE).write_text(json.dumps(record))
    (latest / ".metadata").rename(tmp_path / "metadata")
    metadata = re.escape(str(latest / ".metadata"))
    with pytest.raises(CheckpointMismatch, match=rf"^{metadata}: unreadable \(FileNotFoundError: .*\){way_out}$"):
        trainer.restore(latest)
    (tmp_path / "metadata").rename(latest / ".metadata")
    _cut_in_half(latest / "__0_0.distcp")
    with pytest.raises(RuntimeError, match=rf"^{re.escape(str(latest))}: DCP cannot load it: RuntimeError: "
                                           "PytorchStreamReader"):
        trainer.restore(latest)
    trainer.close()


def _edit_state(checkpoint: Path, **changes: object) -> None:
    """Set ``changes`` in ``checkpoint``'s state file; a value of None removes the key."""
    record = json.loads((checkpoint / STATE_FILE).read_text())
    record.update(changes)
    (checkpoint / STATE_FILE).write_text(json.dumps({k: v for k, v in record.items() if v is not None}))


def test_a_checkpoint_of_a_newer_format_is_refused_naming_both(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A resume or an export refuses, as exit 2 does, a checkpoint written by a rollwave whose format this one does not
    know, rather than load what it may lay out otherwise; a format that is no number is a damaged state file."""
    trainer = _trained(ctx, tiny_model_dir, tmp_path / "run", steps=1)
    latest = trainer.checkpointer.root / "step_00000001"
    assert json.loads((latest / STATE_FILE).read_text())["format"] == FORMAT == 1
    _edit_state(latest, format=FORMAT + 1)
    refusal = re.escape(f"{latest / STATE_FILE}: checkpoint format 2, written by a newer rollwave; this rollwave "
                        "writes format 1 and reads none newer: resume it with the rollwave that wrote it, or start in "
                        "a new run directory")
    with pytest.raises(CheckpointMismatch, match=f"^{refusal}$"):
        trainer.restore(latest)
    with pytest.raises(CheckpointMismatch, match=f"^{refusal}$"):
        export_hf(latest, tiny_model_dir, tmp_path / "hf")
    _edit_state(latest, format="1")
    with pytest.raises(CheckpointMismatch, match=rf"^{re.escape(str(latest / STATE_FILE))}: its format \"1\" is not a "
                                                 "number: checkpoint step_00000001 is damaged"):
        trainer.restore(latest)
    trainer.close()


def test_a_checkpoint_written_before_the_format_resumes_as_format_0(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A state file with no ``format`` (written before it, with ``files`` or before that without) is format 0, which
    this rollwave reads as it did: the weights, step and version come back."""
    trainer = _trained(ctx, tiny_model_dir, tmp_path / "run", steps=1)
    saved = {name: t.clone() for name, t in iter_full_params(trainer.model) if t is not None}
    trainer.train(synthetic_groups(trainer.step, 2))
    first = trainer.checkpointer.root / "step_00000001"
    for dropped in (("format",), ("format", "files")):
        _edit_state(first, **dict.fromkeys(dropped))
        assert trainer.restore(first) and (trainer.step, trainer.version) == (1, 1), dropped
        restored = {name: t for name, t in iter_full_params(trainer.model) if t is not None}
        assert restored.keys() == saved.keys() and all(torch.equal(restored[n], saved[n]) for n in saved), dropped
        trainer.train(synthetic_groups(trainer.step, 2))
    trainer.close()


def test_a_model_directory_whose_weights_do_not_fit_its_config_is_refused_naming_the_tensor(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """transformers starts a tensor the weights lack at random (the policy's, or the critic's body) and fails on one
    of another shape naming neither it nor the directory: each is a ConfigError naming the key, the directory and the
    tensor. Weights of another dtype are cast (fp32), as before."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    lacking = _model_copy(tiny_model_dir, tmp_path / "lacking", lack=LACKED)
    wider = _model_copy(tiny_model_dir, tmp_path / "wider", config={"hidden_size": 256})
    more_words = _model_copy(tiny_model_dir, tmp_path / "more_words", config={"vocab_size": vocab + 100})
    weightless = _model_copy(tiny_model_dir, tmp_path / "weightless")
    (weightless / "model.safetensors").unlink()
    for model, cfg, message in (
        (lacking, {}, f"model.path: {lacking}: its weights lack {LACKED}, which its config.json's model has: it would "
                      "train from random numbers there"),
        (wider, {}, f"model.path: {wider}: its weights' model.embed_tokens.weight has shape [{vocab}, 128], its "
                    f"config.json makes it [{vocab}, 256]: the weights and config.json are not of one model"),
        (more_words, {}, f"model.path: {more_words}: its weights' model.embed_tokens.weight has shape [{vocab}, 128], "
                         f"its config.json makes it [{vocab + 100}, 128]"),
        (weightless, {}, f"model.path: Error no file named model.safetensors, or pytorch_model.bin, found in "
                         f"directory {weightless}"),
        (tiny_model_dir, {"advantage": "gae", "critic": {"path": str(lacking)}},
         f"trainer.critic.path: {lacking}: its weights lack {LACKED}, which its config.json's model has"),
        (tiny_model_dir, {"advantage": "gae", "critic": {"path": str(tmp_path / "nowhere")}},
         f"trainer.critic.path: {tmp_path / 'nowhere'} is not a directory"),
    ):
        with pytest.raises(ConfigError) as refused:
            Trainer(TrainerConfig(**{**CFG, **cfg}), model, tmp_path / "run").start(ctx=ctx)
        assert str(refused.value).startswith(message)


def test_a_checkpoint_of_another_critic_is_refused_naming_the_tensor(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A critic of one layer resumed from a checkpoint of two took the first layer's tensors and dropped the rest
    without a word (two from one failed deep inside DCP). A resume without the critic goes on, and says it drops it."""
    trainer = _trained(ctx, tiny_model_dir, tmp_path, steps=1, advantage="gae")
    trainer.close()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    first_layer = _model_copy(tiny_model_dir, tmp_path / "first_layer",
                              config={"num_hidden_layers": 1, "layer_types": config["layer_types"][:1]})
    gae = TrainerConfig(**{**CFG, "advantage": "gae", "critic": {"path": str(first_layer)}})
    refusal = (r"step_00000001: written for another critic \(trainer\.critic\.path\): it has "
               r"model\.layers\.1\.input_layernorm\.weight, this run's critic does not$")
    with pytest.raises(CheckpointMismatch, match=refusal):
        Trainer(gae, tiny_model_dir, tmp_path).start(resume=True, ctx=ctx)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        resumed = Trainer(TrainerConfig(**CFG), tiny_model_dir, tmp_path).start(resume=True, ctx=ctx)
    resumed.close()
    assert resumed.step == 1
    assert "step_00000001: its critic is not resumed (trainer.advantage is not gae now)" in caplog.text


def test_a_checkpoint_that_cannot_be_written_is_named_and_the_last_complete_one_stays(
    ctx: DistContext, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A write that fails (past RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk) is an OSError naming the checkpoint and
    the room left (DCP's CheckpointException named neither, and no crash record caught it); the last complete
    checkpoint stays listed and loads, the next save removes what was staged, and pruning spares a copy beside the
    checkpoints (whose name made every listing fail)."""
    trainer = _trained(ctx, tiny_model_dir, tmp_path, steps=2, keep_checkpoints=1)
    root = trainer.checkpointer.root
    shutil.copytree(root / "step_00000002", root / "step_00000002.bak")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process lives
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))  # below a shard's 7 MB, above the rest
    try:
        with pytest.raises(OSError, match=rf"^{re.escape(str(root / '.step_00000003.partial'))}: cannot write the "
                                          r"checkpoint: "
                                          r".+ \([\d.]+ GiB free on its file system\); a resume starts from the last "
                                          r"complete one$"):
            trainer.train(synthetic_groups(2, 2))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert trainer.checkpointer.list() == [root / "step_00000002"]
    assert trainer.restore() and trainer.step == 2
    trainer.train(synthetic_groups(2, 2))
    trainer.close()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002.bak", "step_00000003"]


def test_python_m_trainer_exits_2_on_weights_that_do_not_fit_naming_the_tensor(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A ConfigError out of the trainer's start (its model load) is one line and exit 2, as a config error is: a
    launcher restarted it (exit 1) only for it to fail again."""
    model = _model_copy(tiny_model_dir, tmp_path / "lacking", lack=LACKED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_") and k != "REDIS_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", f"run.dir={tmp_path / 'runs'}", "run.name=r", f"model.path={model}",
         "trainer.device=cpu", "trainer.metrics_port=null"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**env, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: model.path: {model}: its weights lack {LACKED}"), errors
