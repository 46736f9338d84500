"""Giving the device back between steps (``placement.mode=colocated``): while the engines generate, the trainer
holds no device memory, and takes its parameters and optimizer state back only for its own turn.

Two ways (``trainer.offload``):
- ``memory_saver``: the model and the optimizer state are allocated inside a torch-memory-saver region (the
  optimizer's lazily, by a hook around its step); ``pause`` copies the region to pinned host memory and unmaps
  it, ``resume`` maps it at the same addresses and copies it back, so every tensor (FSDP2's shards, DTensor
  caches) stays valid. Only CUDA.
- ``cpu``: parameters (``nn.Module.to``, which FSDP2 reshards itself for) and optimizer state move to host
  memory and back, then the caching allocator returns what it cached to the device.
On a CPU device both hold their memory in host memory already: nothing moves. A checkpoint outside the trainer's
turn (the last one, at the end of a run) takes the memory back for as long as it writes.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import logging
from collections.abc import Iterator

import torch
from torch import nn

from core.config import ConfigError, TrainerOffload

log = logging.getLogger(__name__)

REGION_TAG = "rollwave-trainer"


class DeviceOffload:
    """Where the trainer's persistent memory is allocated, and how it leaves the device and comes back. This base
    keeps it (``none``, and any placement where the trainer has the device to itself); the subclasses move it."""

    kind = "none"

    def region(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def offload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        pass

    def onload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        pass


class CpuOffload(DeviceOffload):
    """Parameters and optimizer state to host memory after a step, back before the next."""

    kind = "cpu"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._moved: list[tuple[dict, str]] = []  # optimizer state entries that left the device

    def offload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        for module in modules:
            module.to("cpu")  # the same Parameter objects (swapped in place), so the optimizers still key them
        self._moved = [(state, key) for optimizer in optimizers for state in optimizer.state.values()
                       for key, value in state.items() if isinstance(value, torch.Tensor) and value.is_cuda]
        self._move_state("cpu")
        torch.cuda.empty_cache()

    def onload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        for module in modules:
            module.to(self.device)
        self._move_state(self.device)
        self._moved = []

    def _move_state(self, device: torch.device | str) -> None:
        """Only what was on the device: Adam's step count stays a host scalar unless it is capturable."""
        for state, key in self._moved:
            state[key] = state[key].to(device, non_blocking=True)
        torch.cuda.synchronize()


class MemorySaverOffload(DeviceOffload):
    """torch-memory-saver's region with a CPU backup: pause and resume keep every address. Its allocator (torch
    mode) ends the process (status 1) when the caching allocator returns region memory outside a region, so the
    region's cache is emptied inside one, after each step and at exit."""

    kind = "memory_saver"

    def __init__(self) -> None:
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = "torch"  # the allocator in process: no LD_PRELOAD at the trainer's start
        self._saver = torch_memory_saver
        self._stack = contextlib.ExitStack()
        atexit.register(self._at_exit)

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        with self._saver.region(tag=REGION_TAG, enable_cpu_backup=True):
            yield

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Adam's state is allocated at its first step: every step runs inside the region."""
        optimizer.register_step_pre_hook(lambda *_: self._stack.enter_context(self.region()))
        optimizer.register_step_post_hook(lambda *_: self._stack.close())

    def offload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        torch.cuda.synchronize()
        self._release_cache()  # the optimizer's temporaries, cached in the region: not backed up
        self._saver.pause(REGION_TAG)
        torch.cuda.empty_cache()  # activations and gradients, cached outside it

    def _release_cache(self) -> None:
        """Give the region's cached, unused memory back, inside the region, where its allocator allows it."""
        with self.region():
            torch.cuda.empty_cache()

    def _at_exit(self) -> None:
        """The trainer's tensors are mostly gone by now: their memory leaves inside the region, and the interpreter's
        teardown, which destroys the region's pool, runs as in one (torch-memory-saver's own switch, which its
        ``disable`` uses too)."""
        gc.collect()
        self._release_cache()
        self._saver._impl._binary_wrapper.cdll.tms_set_interesting_region(True)

    def onload(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        self._saver.resume(REGION_TAG)


def device_offload(choice: TrainerOffload, device: torch.device, shared: bool) -> DeviceOffload:
    """The offload ``trainer.offload`` asks for on ``device``; ``shared``: the engines take the device between
    steps (colocated, without the one-step overlap). ConfigError names what ``memory_saver`` lacks."""
    if not shared:
        if choice not in ("auto", "none"):
            log.warning("trainer.offload=%s: the trainer does not share its device (placement.mode decoupled, or "
                        "colocated_staleness 1): nothing is offloaded", choice)
        return DeviceOffload()
    installed = importlib.util.find_spec("torch_memory_saver") is not None
    if choice == "memory_saver":
        if device.type != "cuda":
            raise ConfigError(f"trainer.offload: memory_saver needs a CUDA device; the trainer's is {device.type}")
        if not installed:
            raise ConfigError("trainer.offload: memory_saver needs the torch-memory-saver package "
                              "(pip install 'rollwave[sglang]', or torch-memory-saver alone)")
    if device.type != "cuda" or choice == "none":
        return DeviceOffload()
    if choice == "memory_saver" or (choice == "auto" and installed):
        return MemorySaverOffload()
    return CpuOffload(device)
