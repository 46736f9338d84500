"""Trainer checkpoints (torch.distributed.checkpoint) and HF export.

A checkpoint is a directory ``<run>/checkpoints/step_<n>``: the sharded model and optimizer state as
written by DCP (every rank writes its shards; the directory must be on storage all ranks share), plus
``trainer_state.json`` (step, policy version, LR scheduler, the caller's buffer position and settings), written
last by rank 0, and each rank's RNG state (``rng_rank<r>.pt``: LoRA dropout draws from it). It is staged under a
hidden name, flushed to disk and renamed into place, so a listed checkpoint is complete, after a power loss too.
A pool of another size resumes it: DCP reshards the tensors, and the RNG states, which cannot map one to one, are
taken by the ranks that wrote them; a further rank seeds its RNG from the step and its rank (``rank_seed``) and
those of ranks now gone are not used, which rank 0 logs once.
A resume refuses a checkpoint whose recorded settings (``settings``: dotted key -> value) differ from the run's,
or whose model tensors do not fit the run's model, with an error naming the key or the tensor.
With a critic (``trainer.advantage=gae``) its model and optimizer are in the same DCP checkpoint (``critic``,
``critic_optim``) and its HF config in ``critic_config/``, so the export can rebuild it.
An optimizer written with one parameter group (before the matrices and the 1-D parameters had a group each, for
``trainer.weight_decay``) resumes into the run's groups; another count of groups is refused, naming the checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    AutoTokenizer,
    GenerationConfig,
)

from core.config import LoraConfig
from trainer.lora import add_adapter

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
CRITIC_CONFIG = "critic_config"
_PREFIX = "step_"
Critic = tuple[nn.Module, torch.optim.Optimizer]  # the value model and its optimizer


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class CheckpointMismatch(ValueError):
    """The run directory's checkpoints are not ones this run can start from (or over): starting again cannot
    help, so a component exits as for a config it refuses."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _rng_file(path: Path, rank: int | str) -> Path:
    return path / f"rng_rank{rank}.pt"


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_rng(path: Path) -> None:
    """This rank's torch RNG (CPU, and the current CUDA device's once CUDA is in use), flushed to disk."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    out = _rng_file(path, _rank())
    torch.save(state, out)
    _fsync(out)


def rank_seed(step: int, rank: int) -> int:
    """The RNG seed of a rank that a checkpoint of ``step`` has no RNG state for: the same on every resume of it,
    and a stream of its own per rank (numpy's ``SeedSequence`` spawns independent ones)."""
    return int(np.random.SeedSequence(step, spawn_key=(rank,)).generate_state(1, np.uint64)[0])


def _load_rng(path: Path, step: int) -> None:
    """Continue this rank's RNG where the checkpoint left it. A pool of another size than the one that wrote it
    cannot map the states one to one: a rank it has none for starts from ``rank_seed`` (never the process's own, which
    ``trainer.lora`` seeds alike on every rank), and rank 0 says once what changed."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    written = len(list(path.glob(_rng_file(path, "*").name)))
    if written != world and _is_main():
        if written > world:
            what = f"the RNG state of rank(s) {', '.join(map(str, range(world, written)))} is not used"
        else:
            what = f"rank(s) {', '.join(map(str, range(written, world)))} start their RNG from rank_seed(step, rank)"
        log.warning("%s: written by %d rank(s), resumed by %d: %s", path, written, world, what)
    file = _rng_file(path, _rank())
    if not file.is_file():
        torch.manual_seed(rank_seed(step, _rank()))
        return
    state = torch.load(file, weights_only=True)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_settings(path: Path, saved: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Refuse a resume under settings other than those the checkpoint was written with, naming the key (within a
    section such as ``model.lora``, the field)."""
    for key, value in settings.items():
        if key not in saved or saved[key] == value:
            continue
        old = saved[key]
        if isinstance(old, dict) and isinstance(value, dict):
            key, old, value = next((f"{key}.{k}", old.get(k), value.get(k)) for k in sorted(old.keys() | value.keys())
                                   if old.get(k) != value.get(k))
        raise CheckpointMismatch(f"{path}: written with {key}={json.dumps(old)}, this run has "
                                 f"{key}={json.dumps(value)}: resume with the checkpoint's settings, or start in a "
                                 "new run directory")


def _check_model(path: Path, metadata: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose model tensors are not the run's model's (another model, or LoRA settings a
    checkpoint without them was written under), naming the first tensor, before DCP fails on it deep inside."""
    saved = {key.removeprefix("model."): meta for key, meta in metadata.items()
             if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    for name in sorted(saved.keys() | model.keys()):
        if name not in model:
            problem = f"it has {name}, this run's model does not"
        elif name not in saved:
            problem = f"it lacks {name}, which this run's model has"
        elif tuple(saved[name].size) != tuple(model[name].shape):
            problem = f"its {name} has shape {list(saved[name].size)}, this run's {list(model[name].shape)}"
        else:
            continue
        raise CheckpointMismatch(f"{path}: written for another model (model.path): {problem}")


def _saved_groups(path: Path, metadata: Mapping[str, Any], key: str, own: list[dict[str, Any]]
                  ) -> list[dict[str, Any]]:
    """The param groups to load optimizer ``key`` into: the run's ``own``, or one group of all their parameters
    where the checkpoint has one (written before the decay groups); another count is refused, naming the file."""
    prefix = f"{key}.param_groups."
    saved = len({name.removeprefix(prefix).split(".")[0] for name in metadata if name.startswith(prefix)})
    if saved == len(own):
        return own
    if saved != 1:
        raise CheckpointMismatch(f"{path}: its optimizer {key} has {saved} param groups, this run's has {len(own)}")
    return [{**own[0], "params": [name for group in own for name in group["params"]]}]


def _regroup(loaded: list[dict[str, Any]], own: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's groups ``own`` with the hyperparameters of the checkpoint's one group ``loaded``, but each group's
    own weight decay (the run's config sets them again at a resume)."""
    if len(loaded) == len(own):
        return loaded
    [saved] = loaded
    return [{**saved, "weight_decay": group["weight_decay"], "params": group["params"]} for group in own]


def _shards(model: nn.Module, optimizer: torch.optim.Optimizer, critic: Critic | None) -> dict[str, Any]:
    """The DCP state dicts of the policy and, when there is one, the critic (each rank's shards)."""
    shards = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if critic is not None:
        shards.update(critic=get_model_state_dict(critic[0]), critic_optim=get_optimizer_state_dict(*critic))
    return shards


class Checkpointer:
    """Saves, finds, loads and prunes the checkpoints of one run directory; every rank calls each method."""

    def __init__(self, root: Path, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"trainer.keep_checkpoints: {keep} must be >= 1")
        self.root = Path(root)
        self.keep = keep

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.name.startswith(_PREFIX) and (p / STATE_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name.removeprefix(_PREFIX)))

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1] if found else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        state: dict[str, Any],
        critic: Critic | None = None,
        fence: Callable[[], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step`` (``state`` must be JSON-serialisable) and prune beyond ``keep``. What a crash
        left under a hidden name (a checkpoint half written, or half pruned) goes first: nothing else removes it.

        ``fence`` (called on every rank) raises when a newer trainer of the run started: before anything is written or
        removed, and again before the checkpoint is renamed into place, since the newer trainer resumes from the
        latest one listed (what it refuses stays under its hidden name, for the next save to remove)."""
        final = self.root / f"{_PREFIX}{step:08d}"
        staging = self.root / f".{final.name}.partial"
        if fence is not None:
            fence()
        if _is_main():
            for left in self.root.glob(f".{_PREFIX}*"):
                shutil.rmtree(left)
            staging.mkdir(parents=True)
        _barrier()
        dcp.save(_shards(model, optimizer, critic), checkpoint_id=str(staging))  # DCP flushes its files
        _save_rng(staging)
        _barrier()
        if fence is not None:
            fence()
        if _is_main():
            if critic is not None:
                critic[0].config.save_pretrained(staging / CRITIC_CONFIG)
                for file in (staging / CRITIC_CONFIG).iterdir():
                    _fsync(file)
                _fsync(staging / CRITIC_CONFIG)
            record = {"step": step, "scheduler": scheduler.state_dict(), **state}
            (staging / STATE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            _fsync(staging / STATE_FILE)
            _fsync(staging)
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
            _fsync(self.root)
            for old in self.list()[: -self.keep]:
                doomed = old.rename(self.root / f".{old.name}.pruned")  # never listed half deleted
                shutil.rmtree(doomed)
        _barrier()
        return final

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        critic: Critic | None = None,
        settings: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler, critic and this rank's RNG in place; return the saved trainer state.
        ``settings`` (what ``save`` recorded as ``state["settings"]``) must match what the checkpoint recorded."""
        path = Path(path)
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{path}: not a complete checkpoint ({STATE_FILE} missing)")
        if critic is not None and not (path / CRITIC_CONFIG).is_dir():
            raise CheckpointMismatch(f"{path}: has no critic to resume trainer.advantage=gae from (written without "
                                     "one)")
        record = json.loads(state_file.read_text())
        _check_settings(path, record.get("settings", {}), settings or {})
        shards = _shards(model, optimizer, critic)
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        _check_model(path, metadata, shards["model"])
        own = {key: shards[key]["param_groups"] for key in ("optim", "critic_optim") if key in shards}
        for key, groups in own.items():
            shards[key]["param_groups"] = _saved_groups(path, metadata, key, groups)
        dcp.load(shards, checkpoint_id=str(path))
        for key, groups in own.items():
            shards[key]["param_groups"] = _regroup(shards[key]["param_groups"], groups)
        set_model_state_dict(model, shards["model"])
        set_optimizer_state_dict(model, optimizer, shards["optim"])
        if critic is not None:
            set_model_state_dict(critic[0], shards["critic"])
            set_optimizer_state_dict(*critic, shards["critic_optim"])
        scheduler.load_state_dict(record.pop("scheduler"))
        _load_rng(path, record["step"])
        return record


def export_hf(checkpoint: Path, base_model: Path, out_dir: Path, lora: LoraConfig | None = None,
              merge: bool = False) -> Path:
    """Write checkpoint ``checkpoint`` as an HF model directory (``save_pretrained``) with the tokenizer of
    ``base_model`` (whose config gives the architecture). A LoRA run's checkpoint (``lora``: the run's
    ``model.lora``) is written as a peft adapter directory (for ``PeftModel.from_pretrained`` or SGLang's
    ``--lora-paths``), or with ``merge`` as the merged model with the adapter beside it in ``out_dir/adapter``.
    A checkpoint with a critic also gets it, as an HF token-classification model (one label: the value), in
    ``out_dir/critic``. One process, no process group needed."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / STATE_FILE).is_file():
        raise FileNotFoundError(f"{checkpoint}: not a complete checkpoint ({STATE_FILE} missing)")
    config = AutoConfig.from_pretrained(base_model, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:
        model = add_adapter(model, lora, base_model=str(base_model))
    weights = {"model": model.state_dict()}
    dcp.load(weights, checkpoint_id=str(checkpoint), no_dist=True)
    model.load_state_dict(weights["model"])
    if lora is not None:
        model.save_pretrained(out_dir / "adapter" if merge else out_dir)
        model = model.merge_and_unload() if merge else None
    if model is not None:
        if (Path(base_model) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(base_model, local_files_only=True)
        model.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    if (checkpoint / CRITIC_CONFIG).is_dir():
        critic_config = AutoConfig.from_pretrained(checkpoint / CRITIC_CONFIG, local_files_only=True)
        critic = AutoModelForTokenClassification.from_config(critic_config, dtype=torch.float32)
        weights = {"critic": critic.state_dict()}
        dcp.load(weights, checkpoint_id=str(checkpoint), no_dist=True)
        critic.load_state_dict(weights["critic"])
        critic.save_pretrained(out_dir / "critic")
        tokenizer.save_pretrained(out_dir / "critic")
    return out_dir
