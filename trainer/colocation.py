"""The trainer's side of a colocated run (``placement.mode=colocated``, see ``buffer.colocation``).

``LocalPusher`` is the trainer's ``Pusher`` and ``DeviceShare`` at once: a push writes the full weights as a
safetensors directory on this host (a local push: no gRPC, no snapshot streaming), and around each step the
device changes hands: rank 0 takes it (every live server's engines release their memory first) and gives it
back with the newest weights written, which the servers load before they generate again. The version is
published when it is handed over, so admission opens the next batch only for the weights that will serve it.
Each start takes a new turn epoch, so a step it takes again after a restart is released for anew, and numbers
its first write above every published version (a fresh run's is version 0, which the servers already serve), so
the servers load what a resumed trainer hands over and versions never go back in age. Its directories are named by
its epoch too (``root/v<version>-e<epoch>/``): an older trainer still running, fenced by a newer one and numbering a
version the same, writes beside the newer one's weights, never over them, and its pruning leaves them alone.
With the one-step overlap (``placement.colocated_staleness=1``) the trainer does not take the device: the
engines keep generating on the previous weights while it trains, and load each new version when it is given.
Once a newer trainer of the run started, the turns and the version are refused (``TrainerFenced``; ``DeviceTurns``
and ``StalenessControl`` made with the trainer's buffer as their fence), on every rank.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from buffer.colocation import DeviceTurns
from buffer.registry import ServerRegistry
from buffer.replay import TrainerFenced
from buffer.staleness import StalenessControl
from core.checkpoint_format import MODEL_WEIGHTS
from trainer.checkpoint_pusher import PushResult, PushRound, groups_trained
from trainer.parallel import from_rank0, iter_full_params

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2  # the one the servers load or serve, and the newest
# A version's directory, or one being written: version, epoch (none: written before epochs, older than any start).
_WRITTEN = re.compile(r"\.?v(\d+)(?:-e(\d+))?(?:\.partial)?")


class LocalPusher:
    """Writes each version to ``root/v<version>-e<epoch>/`` and hands the device over (rank 0; other ranks only
    gather)."""

    def __init__(
        self,
        root: Path,
        model_path: Path,
        turns: DeviceTurns | None = None,
        servers: ServerRegistry | None = None,
        staleness: StalenessControl | None = None,
        timeout_s: float = 600.0,
        overlap: bool = False,
    ) -> None:
        self.root = Path(root)
        self.model_path = Path(model_path)
        self.turns = turns
        self.servers = servers
        self._staleness = staleness
        self.timeout_s = timeout_s
        self.overlap = overlap
        self.epoch = turns.new_epoch(self._highest_epoch()) if turns is not None else 0  # this trainer start's
        self.published = 0
        self.last_pushed = 0
        self.written: tuple[int, int] | None = None  # version (in directory(version)), groups trained on
        self.handed_over = False  # a version of this start's: the turn no longer names an older start's directory

    # ---- Pusher -------------------------------------------------------------------------------

    def push_model(self, model: nn.Module, unacked: int = 0) -> PushRound | None:
        """Write the full weights (every rank gathers; rank 0 writes) as the next version: above every version
        published, or a fresh run's first write as version 0. ``unacked``: groups trained into the model that the
        buffer has not counted yet."""
        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in iter_full_params(model) if t is not None}
        written: list[PushRound] = []  # rank 0's round: it stays there (its event does not travel)
        from_rank0(lambda: written.append(self._write(tensors, unacked, start)), "the local push (stage write)")
        return written[0] if written else None

    def _write(self, tensors: dict[str, torch.Tensor], unacked: int, start: float) -> PushRound:
        """Rank 0's part of ``push_model``: the gathered ``tensors`` written as the next version. What fails here
        reaches the other ranks (``from_rank0``): they raise too, naming the stage, where they went on to the step's
        next collective (its checkpoint, the device's hand-over) and waited there for rank 0 until the group's
        timeout."""
        trained = groups_trained(self._staleness, unacked)
        fresh = self.written is None and self.published == 0 and trained == 0
        version = 0 if fresh else max(self.last_pushed, self.published) + 1
        out = self.directory(version)
        partial = out.with_name(f".{out.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            save_file(tensors, partial / MODEL_WEIGHTS)
            config = self.model_path / "config.json"
            if config.exists():  # SGLang reads the directory as a model
                shutil.copy(config, partial / "config.json")
        except BaseException:  # a write that failed (a full tmpfs) leaves no half-written copy holding the space: a
            shutil.rmtree(partial, ignore_errors=True)  # restarted trainer (a new epoch) would prune it only too late
            raise
        shutil.rmtree(out, ignore_errors=True)  # only a dead start's of this epoch: one without turns (epoch 0)
        partial.rename(out)
        self.written, self.last_pushed = (version, trained), version
        self._prune()
        return PushRound(version, [], time.perf_counter() - start, trained)

    def _highest_epoch(self) -> int:
        """The highest epoch of the directories written under ``root`` (0: none)."""
        return max((epoch for _, _, epoch in _written_under(self.root)), default=0)

    def directory(self, version: int) -> Path:
        """Where this start writes ``version``, named by its epoch: no other start writes or removes it."""
        return self.root / f"v{version}-e{self.epoch}"

    def take_results(self) -> list[PushResult]:
        return []

    def flush(self, timeout_s: float | None = None) -> list[str]:
        """No push is ever in flight (each is written before ``push_model`` returns): no server is left unfinished."""
        return []

    # ---- DeviceShare --------------------------------------------------------------------------

    def take_device(self, step: int) -> float:
        """Ask for the device for ``step`` and wait until every live server released it (rank 0; other ranks wait
        for it where the ranks meet; with the overlap, the engines keep it). Returns the seconds waited; TimeoutError
        names the servers that did not release."""
        start = time.perf_counter()
        _on_rank0(self._take if self.turns is not None and not self.overlap else None, step)
        return time.perf_counter() - start

    def give_device(self, step: int) -> None:
        """Hand the device back after ``step`` with the newest weights written, and publish their version (rank 0;
        the ranks meet there when there are more)."""
        _on_rank0(self._give if self.turns is not None else None, step)

    def _take(self, step: int) -> None:
        assert self.turns is not None and self.servers is not None
        turn = self.turns.take(self.epoch, step)
        self.turns.wait_released(turn, self.servers, self.timeout_s)

    def _give(self, step: int) -> None:
        assert self.turns is not None
        if self.written is None:
            raise RuntimeError("give_device before any weights were written: push_model first")
        version, trained = self.written
        if self._staleness is not None:  # first: a version handed over is published (a newer trainer numbers above)
            self._staleness.set_version(version, trained)
        self.turns.give(self.epoch, step, version, str(self.directory(version)))
        self.published = max(self.published, version)
        self.handed_over = True

    def _prune(self) -> None:
        """Remove this start's versions before its last ``KEEP_VERSIONS`` and, once it handed one over (until then the
        turn may name an older start's), every directory of the starts before it, partial ones too. A newer start's
        are never touched: this start may be one it fenced, still writing, whose turns are refused."""
        for path, version, epoch in _written_under(self.root):
            if (epoch == self.epoch and version <= self.last_pushed - KEEP_VERSIONS) or (
                epoch < self.epoch and self.handed_over
            ):
                shutil.rmtree(path, ignore_errors=True)


def _written_under(root: Path) -> Iterator[tuple[Path, int, int]]:
    """Each version directory under ``root``, written or being written: its path, version and epoch."""
    for path in root.iterdir() if root.is_dir() else ():
        written = _WRITTEN.fullmatch(path.name)
        if written is not None:
            yield path, int(written[1]), int(written[2] or 0)


def _on_rank0(act: Callable[[int], None] | None, step: int) -> None:
    """Rank 0's part of a hand-over (``act``; None: nothing to do), then, with more ranks, the meeting of all of
    them, where a refusal (``TrainerFenced``: a newer trainer of the run started) or a failure (servers that did not
    release the device) reaches every rank: all of them stop, none waits in the step's collectives for one that left."""
    from_rank0(lambda: act(step) if act is not None else None, f"the device's hand-over at step {step}",
               (TrainerFenced,))


def held_bytes(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes this rank keeps between steps: the parameters of its models (policy, reference, critic) and their
    optimizers' state (its shards under FSDP2; gradients are freed each step), on the device unless
    ``trainer.offload`` moves them off it."""
    tensors = [p for module in modules for p in module.parameters()]
    for optimizer in optimizers:
        tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)
