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
The state file records each file's size and CRC-32 (``files``; DCP's files carry no checksum, so a shard damaged past
its headers loaded as other numbers): a resume or an export refuses a checkpoint whose files differ, naming the file
and the way out. A save that fails names the checkpoint and the room left on its file system; where one rank's part of
it fails (rank 0's staging, state file, rename and prune; any rank's RNG state or read back), or is interrupted
(KeyboardInterrupt, SystemExit), every other rank raises at once naming that rank and the cause, rather than wait in
the next collective until the group's timeout; DCP shares a failure writing the shards itself, and every rank raises it.
A rank interrupted within DCP's collectives raises at once, in no further collective (the others are in DCP's next);
a stop or an interrupt that DCP caught in its steps is raised as it was, not as a checkpoint that fails to write or
load.
The state file records its ``format`` (``FORMAT``; one without is format 0, written before the field, and loads as
before): a checkpoint of a newer format than this code's is refused, naming both.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
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
from trainer.parallel import ended

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
FORMAT = 1  # what ``format`` in the state file says this code writes; a higher one is refused at load
CRITIC_CONFIG = "critic_config"
_PREFIX = "step_"
_NAME = re.compile(rf"{_PREFIX}(\d+)")  # a checkpoint's directory; a copy beside it (step_00000004.bak) is none
_METADATA = ".metadata"  # DCP's index of the shards
_CHUNK = 1 << 24
Critic = tuple[nn.Module, torch.optim.Optimizer]  # the value model and its optimizer


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class CheckpointMismatch(ValueError):
    """The run directory's checkpoints are not ones this run can start from (or over): starting again cannot
    help, so a component exits as for a config it refuses."""


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


def _step(path: Path) -> int | None:
    """The step of checkpoint directory ``path``; None for a name that is none."""
    match = _NAME.fullmatch(path.name)
    return int(match[1]) if match else None


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (their state file written last), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _step(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def _cause(exc: BaseException) -> str:
    """What went wrong, in one line: of DCP's CheckpointException (every rank's tracebacks), the first failure's."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _damaged(path: Path, problem: str) -> CheckpointMismatch:
    """The refusal of checkpoint ``path``, which does not hold what was written (``problem``), with the way out: no
    resume falls back to an earlier checkpoint by itself, since the groups trained after that one were acked."""
    listed = [p.resolve() for p in _complete(path.parent)]
    earlier = listed[: listed.index(path.resolve())] if path.resolve() in listed else []
    then = f"resume from {earlier[-1].name}" if earlier else "start from model.path"
    return CheckpointMismatch(f"{problem}: checkpoint {path.name} is damaged: restore it from a copy, or move it out "
                              f"of {path.parent} to {then} (the groups trained since were acked: they are not "
                              "trained again); an export can take another checkpoint (--checkpoint DIR)")


def _read_state(path: Path) -> dict[str, Any]:
    """The state file of checkpoint ``path``; one cut short or edited into no state is refused, naming it."""
    file = path / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint ({STATE_FILE} missing)")
    try:
        record = json.loads(file.read_text())
    except ValueError as exc:  # JSONDecodeError names the line and column; UnicodeDecodeError the byte
        raise _damaged(path, f"{file}: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int) or "scheduler" not in record:
        raise _damaged(path, f"{file}: holds no step and scheduler state")
    written = record.get("format", 0)
    if not isinstance(written, int):
        raise _damaged(path, f"{file}: its format {json.dumps(written)} is not a number")
    if written > FORMAT:
        raise CheckpointMismatch(f"{file}: checkpoint format {written}, written by a newer rollwave; this rollwave "
                                 f"writes format {FORMAT} and reads none newer: resume it with the rollwave that wrote "
                                 "it, or start in a new run directory")
    return record


def _digest(file: Path) -> list[int]:
    """[bytes, CRC-32] of ``file``, as the state file records it."""
    size = crc = 0
    with file.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            size += len(chunk)
            crc = zlib.crc32(chunk, crc)
    return [size, crc]


def _gathered(local: list[Any]) -> list[Any]:
    """Every rank's ``local`` items, in rank order (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return [item for part in parts for item in part]


def _share(names: Iterable[str]) -> list[str]:
    """This rank's share of ``names`` (every world-th), so that the ranks read a checkpoint's files in parallel."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return sorted(names)[_rank()::world]


def _data_files(metadata: Metadata) -> list[str]:
    """What ``dcp.save`` and ``_save_rng`` wrote: every rank's shards, DCP's index and every rank's RNG state."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = {info.relative_path for info in metadata.storage_data.values()}
    return sorted(shards | {_METADATA} | {_rng_file(Path(), rank).name for rank in range(world)})


def _difference(file: Path, size: int, crc: int) -> str | None:
    """How ``file`` differs from the ``size`` and ``crc`` it was written with; None where it does not."""
    if not file.is_file():
        return "missing"
    got_size, got_crc = _digest(file)
    if got_size != size:
        return f"{got_size} bytes, {size} were written"
    return None if got_crc == crc else "its bytes differ from those written (CRC-32)"


def _check_files(path: Path, record: Mapping[str, Any]) -> None:
    """Refuse checkpoint ``path`` where a file differs from what its state file records, naming the first (every rank
    reads its share, and all refuse alike). One written before the record is read as it is."""
    files = record.get("files")
    if files is None:
        return
    found = _gathered([(name, _difference(path / name, *files[name])) for name in _share(files)])
    if damaged := sorted((name, why) for name, why in found if why is not None):
        name, why = damaged[0]
        raise _damaged(path, f"{path / name}: {why}")


def _read_metadata(path: Path) -> Metadata:
    """DCP's index of checkpoint ``path``; missing or unreadable, refused naming it."""
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # missing, or cut short: unpickling raises whatever the bytes make it
        raise _damaged(path, f"{path / _METADATA}: unreadable ({_cause(exc)})") from None


def _free(path: Path) -> str:
    """The room left on the file system of ``path`` (of its nearest existing parent: it may not exist yet)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    return f"{shutil.disk_usage(existing).free / 2**30:.1f} GiB"


def _raise_interruption(exc: BaseException) -> None:
    """Raise as it was the stop or interrupt (``TrainerStopped``, KeyboardInterrupt, SystemExit) that DCP caught in one
    of its steps, where ``exc`` is DCP's error holding one: DCP wraps whatever its steps raise, and its collectives hand
    it to every rank. It is no failure to write or read the checkpoint (a lone rank's SIGTERM during DCP's writes was
    recorded as one, and exited 1, not 143; a Ctrl-C during an export was a checkpoint that does not load)."""
    if isinstance(exc, CheckpointException):
        stop = next((error for error, _ in exc.failures.values() if not isinstance(error, Exception)), None)
        if stop is not None:
            raise stop from None


@contextlib.contextmanager
def _writing(staging: Path) -> Iterator[None]:
    """An error writing checkpoint ``staging`` as one naming it, its cause and the room left on its file system (DCP's
    names neither, and is a BaseException, which the trainer's crash record let through). What was staged goes at the
    next save; the last complete checkpoint stays the one a resume starts from. An interruption DCP caught is raised as
    it was (``_raise_interruption``)."""
    try:
        yield
    except (Exception, CheckpointException) as exc:
        _raise_interruption(exc)
        raise OSError(f"{staging}: cannot write the checkpoint: {_cause(exc)} ({_free(staging)} free on its file "
                      "system); a resume starts from the last complete one") from exc


T = TypeVar("T")


def _meet(act: Callable[[], T], step: int, path: Path, main_only: bool = False) -> T | None:
    """A part of saving checkpoint ``step`` at ``path``: ``act`` on every rank (rank 0 alone with ``main_only``;
    the others get None), then the meeting of every rank, where any rank's failure reaches them all at once: a rank
    that failed raises its own exception (a KeyboardInterrupt or SystemExit too), the others one naming the first rank
    that failed or was interrupted and why, instead of waiting in the next collective until the group's timeout. The
    meeting also holds every rank until ``act`` is done on all of them.

    ``act`` holds no collective: then wherever it fails or is interrupted, the others are in it or in the meeting.
    One that held some (``dcp.save``'s) could be interrupted between two of them (a signal's KeyboardInterrupt is
    raised as a collective returns), and its rank went on to the meeting while the others were in the act's next
    collective, which the meeting then met: a mismatch, a hang until the group's timeout or a gloo abort."""
    result, failure, error = None, None, None
    if not main_only or _is_main():
        try:
            result = act()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            error, failure = exc, ended(exc, _cause(exc))
    failures = _gathered([failure])
    if error is not None:
        raise error
    for rank, how in enumerate(failures):
        if how is not None:
            raise RuntimeError(f"checkpoint of step {step} ({path}): rank {rank} {how}")
    return result


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


_SOURCES = {"model": "model.path", "critic": "trainer.critic.path"}  # where the run's tensors of each come from


def _check_model(path: Path, metadata: Mapping[str, Any], key: str, model: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose ``key`` tensors (``model``: the policy's, or the ``critic``'s) are not the run's
    (another model, or LoRA settings a checkpoint without them was written under), naming the first tensor, before
    DCP fails on it deep inside or, for a tensor the checkpoint has and the run's lacks, loads the rest silently."""
    saved = {name.removeprefix(f"{key}."): meta for name, meta in metadata.items()
             if name.startswith(f"{key}.") and isinstance(meta, TensorStorageMetadata)}
    for name in sorted(saved.keys() | model.keys()):
        if name not in model:
            problem = f"it has {name}, this run's {key} does not"
        elif name not in saved:
            problem = f"it lacks {name}, which this run's {key} has"
        elif tuple(saved[name].size) != tuple(model[name].shape):
            problem = f"its {name} has shape {list(saved[name].size)}, this run's {list(model[name].shape)}"
        else:
            continue
        raise CheckpointMismatch(f"{path}: written for another {key} ({_SOURCES[key]}): {problem}")


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
        return _complete(self.root)

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

        def stage() -> None:
            with _writing(staging):
                for left in self.root.glob(f".{_PREFIX}*"):
                    shutil.rmtree(left)
                staging.mkdir(parents=True)

        _meet(stage, step, final, main_only=True)
        shards = _shards(model, optimizer, critic)
        with _writing(staging):  # in no meeting (``_meet``): DCP's collectives share its failures, every rank raises
            metadata = dcp.save(shards, checkpoint_id=str(staging))  # DCP flushes its files

        def write_rng() -> None:
            with _writing(staging):
                _save_rng(staging)

        _meet(write_rng, step, final)

        def read_back() -> list[tuple[str, list[int]]]:  # this rank's share of what they all wrote
            with _writing(staging):
                return [(name, _digest(staging / name)) for name in _share(_data_files(metadata))]

        files = dict(_gathered(_meet(read_back, step, final)))
        if fence is not None:
            fence()

        def commit() -> None:
            with _writing(staging):
                if critic is not None:
                    critic[0].config.save_pretrained(staging / CRITIC_CONFIG)
                    for file in (staging / CRITIC_CONFIG).iterdir():
                        _fsync(file)
                        files[f"{CRITIC_CONFIG}/{file.name}"] = _digest(file)
                    _fsync(staging / CRITIC_CONFIG)
                record = {"step": step, "scheduler": scheduler.state_dict(), **state, "files": files, "format": FORMAT}
                (staging / STATE_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
                _fsync(staging / STATE_FILE)
                _fsync(staging)
                shutil.rmtree(final, ignore_errors=True)
                staging.rename(final)
                _fsync(self.root)
            for old in self.list()[: -self.keep]:
                doomed = old.rename(self.root / f".{old.name}.pruned")  # never listed half deleted
                shutil.rmtree(doomed)

        _meet(commit, step, final, main_only=True)
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
        record = _read_state(path)
        if critic is not None and not (path / CRITIC_CONFIG).is_dir():
            raise CheckpointMismatch(f"{path}: has no critic to resume trainer.advantage=gae from (written without "
                                     "one)")
        if critic is None and (path / CRITIC_CONFIG).is_dir():
            log.warning("%s: its critic is not resumed (trainer.advantage is not gae now), and the next checkpoints "
                        "hold none", path)
        _check_settings(path, record.get("settings", {}), settings or {})
        _check_files(path, record)
        shards = _shards(model, optimizer, critic)
        metadata = _read_metadata(path).state_dict_metadata
        for key in ("model", "critic"):
            if key in shards:
                _check_model(path, metadata, key, shards[key])
        own = {key: shards[key]["param_groups"] for key in ("optim", "critic_optim") if key in shards}
        for key, groups in own.items():
            shards[key]["param_groups"] = _saved_groups(path, metadata, key, groups)
        try:
            dcp.load(shards, checkpoint_id=str(path))
        except CheckpointException as exc:  # a BaseException, which the trainer's crash record let through
            _raise_interruption(exc)
            raise RuntimeError(f"{path}: DCP cannot load it: {_cause(exc)}") from exc
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


def _load_for_export(module: torch.nn.Module, key: str, checkpoint: Path, config: Path) -> None:
    """``module``'s weights from ``checkpoint``'s ``key``; a checkpoint of another shape (not written from
    ``config``'s model) is refused naming both."""
    weights = {key: module.state_dict()}
    try:
        dcp.load(weights, checkpoint_id=str(checkpoint), no_dist=True)
        module.load_state_dict(weights[key])
    except (Exception, CheckpointException) as exc:
        _raise_interruption(exc)
        raise CheckpointMismatch(f"{checkpoint}: its {key} does not load into the model of {config}: "
                                 f"{_cause(exc)}") from None


def export_hf(checkpoint: Path, base_model: Path, out_dir: Path, lora: LoraConfig | None = None,
              merge: bool = False) -> Path:
    """Write checkpoint ``checkpoint`` as an HF model directory (``save_pretrained``) with the tokenizer of
    ``base_model`` (whose config gives the architecture). A LoRA run's checkpoint (``lora``: the run's
    ``model.lora``) is written as a peft adapter directory (for ``PeftModel.from_pretrained`` or SGLang's
    ``--lora-paths``), or with ``merge`` as the merged model with the adapter beside it in ``out_dir/adapter``.
    A checkpoint with a critic also gets it, as an HF token-classification model (one label: the value), in
    ``out_dir/critic``. One process, no process group needed."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    _check_files(checkpoint, _read_state(checkpoint))
    config = AutoConfig.from_pretrained(base_model, local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:
        model = add_adapter(model, lora, base_model=str(base_model))
    _load_for_export(model, "model", checkpoint, base_model)
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
        _load_for_export(critic, "critic", checkpoint, checkpoint / CRITIC_CONFIG)
        critic.save_pretrained(out_dir / "critic")
        tokenizer.save_pretrained(out_dir / "critic")
    return out_dir
