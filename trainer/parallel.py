"""Distributed wiring: process group, FSDP2 model, full-parameter streaming.

One process per rank (torchrun or the Ray launcher sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT);
gloo and fp32 on CPU, NCCL and bf16 compute (fp32 master weights and gradient reduction) on GPU.
FSDP2 ``fully_shard`` wraps each decoder layer, then the root (embeddings, final norm, LM head).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedModel

from core.config import ConfigError
from core.net import is_loopback, listen_socket

log = logging.getLogger(__name__)
T = TypeVar("T")
CLOSED_KEY = "rollwave/ranks_closed"  # in the rendezvous store: ranks that have destroyed their group
_WRAPPER_PARTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


@dataclass
class DistContext:
    """This process's place in the trainer pool."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: str) -> torch.device:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is an error, not a silent fallback."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device: cuda requested but torch sees no GPU")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _rendezvous_store(host: str, port: int, rank: int, world: int, timeout: timedelta) -> dist.Store:
    """The pool's TCPStore, hosted by rank 0 on ``host`` only (torch's own binds every address of the machine,
    so a pool on one host would take rendezvous traffic from the network). Rank 0 retries its port while it is
    busy (e.g. by the rank it replaces), so a restarted pool does not die on its old port. Under torchrun its
    agent hosts the store (``TORCHELASTIC_USE_AGENT_STORE``) and every rank is a client."""
    if rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    listener = listen_socket(host, port, "trainer rendezvous (MASTER_PORT)")
    return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, multi_tenant=True,
                         master_listen_fd=listener.detach())


def _collectives_on_loopback() -> None:
    """gloo and NCCL listen on the address the hostname resolves to, the network's in most containers, unless
    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise: default them to ``lo``."""
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, "lo")


def _join_env_group(backend: str, timeout_s: float) -> None:
    """Rendezvous at MASTER_ADDR:MASTER_PORT; a loopback address keeps the whole pool's sockets on loopback
    (unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise). A rank missing after ``timeout_s`` is an
    error naming the pool's address, this rank and the stage."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    where = f"trainer rendezvous at {host}:{port} (rank {rank} of {world})"
    timeout = timedelta(seconds=timeout_s)
    if is_loopback(host):
        _collectives_on_loopback()
    try:
        store = _rendezvous_store(host, port, rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except dist.DistNetworkError as exc:
        raise ConnectionError(f"{where}: {str(exc).splitlines()[0]} (trainer.dist_timeout_s)") from None
    except dist.DistStoreError as exc:
        raise TimeoutError(f"{where}: {str(exc).splitlines()[0]} (trainer.dist_timeout_s)") from None
    except OSError as exc:  # rank 0 cannot listen there: MASTER_ADDR is not this host's, or the port stayed busy
        raise ConnectionError(f"{where}: cannot listen: {exc}") from None


def several_ranks() -> bool:
    """Whether this process is one rank of a pool of several (torchrun's or the launcher's ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the process group from torchrun's environment.

    A pool of one (no RANK/WORLD_SIZE, or WORLD_SIZE=1) needs no rendezvous: its store is in-process,
    so ``python -m trainer`` runs without torchrun. Its gloo group still listens for peers (none come), on
    loopback: on the address the hostname resolves to it would listen on the network. An existing group (tests
    with ``mp.spawn``) is reused.
    """
    dev = resolve_device(device)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if several_ranks():
            missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} is not")
            _join_env_group(backend, timeout_s)
        else:
            _collectives_on_loopback()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    world = dist.get_world_size()
    return DistContext(dist.get_rank(), world, dev, init_device_mesh(dev.type, (world,)))


def close_distributed(timeout_s: float = 120.0) -> None:
    """Leave the process group together: a rank whose gloo peers go away while its own group is still up
    aborts ("terminate called without an active exception"). So every rank destroys its group after a
    barrier, then counts itself out in the rendezvous store, and rank 0, whose process hosts the store,
    exits only after every rank has counted itself out. Where FSDP2 still holds the group, its gloo threads
    outlive this: a rank then ends its process with ``exit_rank``."""
    if not dist.is_initialized():
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store() if world > 1 else None
    if store is not None:
        dist.barrier()
    dist.destroy_process_group()
    if store is None:
        return
    left = store.add(CLOSED_KEY, 1)
    deadline = time.monotonic() + timeout_s
    while rank == 0 and left < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"closing the trainer's process group: {world - left} of {world} ranks never "
                               f"left it within {timeout_s:g} s")
        time.sleep(0.01)
        left = store.add(CLOSED_KEY, 0)
    log.info("rank %d of %d left the trainer's process group", rank, world)


def ended(exc: BaseException, cause: str) -> str:
    """How a rank's part ended, for the other ranks' error: ``cause`` interrupted it (a KeyboardInterrupt or
    SystemExit: a signal, a launcher stopping the pool) or failed it."""
    return f"{'was interrupted' if isinstance(exc, (KeyboardInterrupt, SystemExit)) else 'failed'}: {cause}"


def from_rank0(act: Callable[[], T], what: str, kept: tuple[type[Exception], ...] = ()) -> T:
    """``act()`` on rank 0 (the other ranks never call it), its result given to every rank. What it raises reaches
    every rank at once, so none waits in the next collective for a rank that left: rank 0 raises its own exception
    (a KeyboardInterrupt or SystemExit too, after telling the others), the others one of ``kept``'s types as itself
    (its message kept: ``TrainerFenced``), any other as a RuntimeError naming ``what`` and rank 0's cause."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return act()
    box: list[Any] = [None]
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (act(), None)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the other ranks know
            error = exc
            kind = next((i for i, t in enumerate(kept) if isinstance(exc, t)), None)
            cause = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            box[0] = (None, (kind, str(exc), ended(exc, cause)))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    result, failure = box[0]
    if failure is None:
        return result
    kind, message, how = failure
    if kind is not None:
        raise kept[kind](message)
    raise RuntimeError(f"{what}: rank 0 {how}")


class TrainerStopped(BaseException):
    """SIGTERM, a supervisor's or an operator's stop (Kubernetes, LocalStack, Ray, ``kill``), or SIGINT (a terminal's
    Ctrl-C, which torchrun passes on to each rank), raised in the main thread (``request_stop``): the stack unwinds
    (the lease deleted, the pushers closed) and rank 0 records the stop as the run's end, as a crash (a restart clears
    it): it used to die on the spot, recording nothing, and its lapsed lease then read as a trainer killed by SIGKILL or
    the OOM killer. A BaseException, as KeyboardInterrupt is, so no handler of errors takes it for one of theirs.
    ``signum``: the signal, for the exit status (128 + it, as a shell reports a process it ended)."""

    signum: int = signal.SIGTERM


_stop_signal = 0  # the signal that asked this rank to stop; a pool stops at its next ``stop_point``
# A stop point is a host sync (its all_reduce's result read back): one every few micro-batches keeps the device's queue
# full, and a stop still comes within a few micro-batches' time.
STOP_EVERY_MICRO_BATCHES = 4


def _stopped_by(signum: int, here: bool) -> TrainerStopped:
    where = "" if here else " to another rank of the pool"
    stopped = TrainerStopped(f"stopped by {signal.Signals(signum).name}{where} before its end (a supervisor's or an "
                             "operator's stop)")
    stopped.signum = signum
    return stopped


def request_stop(signum: int) -> None:
    """A signal's stop (its handler's, in the main thread). A lone rank raises ``TrainerStopped`` where it is; a rank
    of a pool stops with the others at their next ``stop_point``. Raised where the signal found each rank (one as a
    collective returned, another between two), a SIGTERM to every rank at once sent them on to different collectives
    (a checkpoint's meeting, DCP's own, ``from_rank0``'s telling the others), where they waited for the group's
    timeout, or one left the pool while another still waited in it, which failed (exit 1, its crash recorded as a
    gloo error) or aborted (134).

    A signal once the stop is asked (another supervisor's, torchrun's passing on an operator's, a second Ctrl-C) is
    logged and changes nothing: the stop goes on, its record written and the pool left together, and the process
    exits 128 + the first signal. The handler used to give the signals back to their default action at the first,
    so a second one killed the rank where it was, in the closing meeting too, and a peer still in that meeting
    failed (exit 1). SIGKILL ends a rank at once (torchrun's after its ``--shutdown-timeout``, a pod's after its
    grace)."""
    global _stop_signal
    if _stop_signal:
        log.warning("%s while stopping for %s: the stop goes on (SIGKILL ends the process at once)",
                    signal.Signals(signum).name, signal.Signals(_stop_signal).name)
        return
    _stop_signal = signum
    if not several_ranks():
        raise _stopped_by(signum, here=True)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # a supervisor's or an operator's stop; Ctrl-C, which torchrun passes on


def stop_on_signals() -> None:
    """Stop at a SIGTERM or a SIGINT (``request_stop``: a lone rank at once, a pool's ranks together at their next stop
    point); a second one is logged and the stop goes on. A SIGINT raised KeyboardInterrupt where it found each rank of
    a pool, as a SIGTERM once did: one went on to a collective the others never joined (a checkpoint's meeting while
    the others were in DCP's next), or left the pool while another still waited in it. A stop asked of an earlier run
    in this process is forgotten: it stopped that run, not this one."""
    global _stop_signal
    _stop_signal = 0

    def stop(signum: int, _frame: object) -> None:
        request_stop(signum)

    for stop_signal in STOP_SIGNALS:
        signal.signal(stop_signal, stop)


def stop_point(device: torch.device) -> None:
    """Raise ``TrainerStopped`` on every rank once any rank of the pool was asked to stop (``request_stop``): a
    collective every rank calls at the same point, where none is in another, so they all leave the pool from here. A
    rank that was not signalled says the stop came to another."""
    signum = _stop_signal
    if dist.is_initialized() and dist.get_world_size() > 1:
        asked = torch.tensor([signum], device=device)
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        signum = int(asked.item())
    if signum:
        raise _stopped_by(signum, here=signum == _stop_signal)


def stopping(micro_batches: Iterable[T], device: torch.device) -> Iterator[tuple[int, T]]:
    """``enumerate(micro_batches)``, with a ``stop_point`` before every ``STOP_EVERY_MICRO_BATCHES``-th after the
    first: a pass of a step (the policy's or the critic's) stops within a few micro-batches, not at its end. Every rank
    runs as many micro-batches (``plan_ranks``), so all reach each stop point."""
    for i, mb in enumerate(micro_batches):
        if i and i % STOP_EVERY_MICRO_BATCHES == 0:
            stop_point(device)
        yield i, mb


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank's process once everything it opened is closed; one of several ranks skips the interpreter's
    teardown. FSDP2's DTensors (parameters, optimizer state, DTensor's sharding caches) keep the gloo group, and
    its threads, alive past ``close_distributed``, so a rank tears down while they still run; a peer's process
    exiting then made a rank abort ("terminate called without an active exception", twice in CI, raised off the
    Python threads while the main thread was in teardown). A rank that is alone exits as usual."""
    if not several_ranks():
        sys.exit(code)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks of an HF causal LM (``model.model.layers`` for Qwen2/Llama)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected get_decoder().layers)")
    return layers


def load_model(path: Path | str, ctx: DistContext,
               prepare: Callable[[PreTrainedModel], nn.Module] | None = None) -> PreTrainedModel:
    """Load an HF causal LM in fp32 on every rank and shard it with FSDP2 (each layer, then the root).

    Dropout is switched off (``eval()``): the training forward must compute the same function as the
    proximal-logprob forward. LoRA's adapter dropout is the exception (``trainer.lora``): it acts in the training
    forward, and the step then computes π_prox in a no-grad pass. ``prepare`` changes the model before it is
    sharded (``trainer.lora`` adds the adapter there). Each rank reads the full checkpoint once before sharding;
    fine up to a few billion parameters per host.
    """
    model = causal_lm(path)
    if prepare is not None:
        model = prepare(model)
    model.to(ctx.device)
    model.eval()
    return shard_model(model, ctx)


def causal_lm(path: Path | str, key: str = "model.path") -> PreTrainedModel:
    """The HF causal LM at ``path`` in fp32 on the CPU (``from_pretrained``); a ConfigError naming ``key`` for weights
    that lack a tensor of the model their config.json makes, which would be trained from random numbers."""
    model, missing = from_pretrained(AutoModelForCausalLM, path, key)
    if missing:
        raise ConfigError(f"{key}: {path}: its weights lack {sorted(missing)[0]}, which its config.json's model "
                          "has: it would train from random numbers there; give the weights of that model")
    return model


def from_pretrained(cls: type[AutoModelForCausalLM] | type[AutoModelForTokenClassification], path: Path | str,
                    key: str, own_head: bool = False, **kwargs: Any) -> tuple[PreTrainedModel, set[str]]:
    """``cls.from_pretrained(path)`` in fp32 and the names of the tensors its weights lack (transformers starts them
    at random), for the caller to refuse or fill. A directory that holds no model (no config.json, no weights) or
    weights of another shape than its config.json says is a ConfigError naming ``key``, the directory and the tensor
    (transformers' own error names neither, and the trainer exits 2 on it: no restart can help). ``own_head``: the
    tensors outside the base model are the caller's shape (a value head's one output, ``num_labels=1``), so saved
    ones of another shape (a classifier's head) count as lacking, not as a mismatch."""
    if not Path(path).is_dir():
        raise ConfigError(f"{key}: {path} is not a directory (an HF model directory is expected)")
    try:
        model, info = cls.from_pretrained(path, dtype=torch.float32, local_files_only=True, output_loading_info=True,
                                          ignore_mismatched_sizes=True, **kwargs)
    except OSError as exc:  # transformers': no config.json, no weights file, a config that is not JSON
        raise ConfigError(f"{key}: {exc}") from None
    missing, mismatched = set(info["missing_keys"]), sorted(info["mismatched_keys"])
    if own_head:
        head = [m for m in mismatched if not m[0].startswith(f"{model.base_model_prefix}.")]
        for name, saved, wanted in head:
            log.warning("%s: %s: its weights' %s has shape %s, this model's is %s: it is not loaded", key, path, name,
                        list(saved), list(wanted))
        missing |= {m[0] for m in head}
        mismatched = [m for m in mismatched if m not in head]
    if mismatched:
        name, saved, wanted = mismatched[0]
        raise ConfigError(f"{key}: {path}: its weights' {name} has shape {list(saved)}, its config.json makes it "
                          f"{list(wanted)}: the weights and config.json are not of one model")
    return model, missing


def shard_model(model: PreTrainedModel, ctx: DistContext) -> PreTrainedModel:
    if ctx.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=ctx.mesh, mp_policy=mp)
    fully_shard(model, mesh=ctx.mesh, mp_policy=mp)
    return model


def hf_name(name: str) -> str:
    """A parameter name as HF checkpoints spell it (wrapper parts such as ``_orig_mod.`` removed)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def iter_full_params(model: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(hf_name, full tensor)`` one parameter at a time; every rank must iterate in step.

    Each FSDP2 shard is all-gathered (``DTensor.full_tensor()``, a collective) and the full tensor is
    kept on rank 0 only (other ranks get None), so rank 0 never holds the whole model twice. Tied
    parameters (e.g. ``lm_head.weight`` = ``model.embed_tokens.weight``) are yielded once.
    """
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        yield hf_name(name), (full.detach() if is_main else None)
        del full
