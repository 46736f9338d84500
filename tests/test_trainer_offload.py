"""The trainer's offload between steps in colocated placement (the ``trainer.offload`` key, trainer/offload.py).

On CPU: the choice is refused where it cannot work, and a step runs in the order the engines need (device taken,
memory back, train, checkpoint, memory out, device given). The ``cuda`` tests run where torch sees a GPU
(``make test-cuda``): each way frees the device between steps and trains exactly the numbers of keeping it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from core.config import BufferConfig, ConfigError, TrainerConfig
from tests.trainer_helpers import synthetic_groups
from trainer.colocation import LocalPusher
from trainer.offload import DeviceOffload, device_offload
from trainer.worker import Trainer


def test_memory_saver_is_refused_on_a_cpu_device_and_the_error_names_the_key() -> None:
    with pytest.raises(ConfigError, match="trainer.offload: memory_saver needs a CUDA device; the trainer's is cpu"):
        device_offload("memory_saver", torch.device("cpu"), shared=True)
    assert device_offload("memory_saver", torch.device("cpu"), shared=False).kind == "none"  # nothing to share
    assert device_offload("cpu", torch.device("cpu"), shared=True).kind == "none"  # host memory already


class RecordingOffload(DeviceOffload):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def offload(self, modules, optimizers) -> None:
        self.events.append("offload")

    def onload(self, modules, optimizers) -> None:
        self.events.append("onload")


class RecordingShare(LocalPusher):
    def __init__(self, root: Path, model_dir: Path, events: list[str]) -> None:
        super().__init__(root, model_dir)
        self.events = events

    def take_device(self, step: int) -> float:
        self.events.append(f"take {step}")
        return super().take_device(step)

    def give_device(self, step: int) -> None:
        self.events.append(f"give {step}")
        super().give_device(step)


def test_a_colocated_step_takes_memory_back_after_the_engines_release_and_checkpoints_before_giving_it(
    ctx, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    monkeypatch.setattr("trainer.worker.device_offload", lambda *_: RecordingOffload(events))
    share = RecordingShare(tmp_path / "push", tiny_model_dir, events)
    registry = CollectorRegistry()
    trainer = Trainer(TrainerConfig(total_steps=10, checkpoint_every=2, lr=1e-3, device="cpu"),
                      tiny_model_dir, tmp_path / "run", BufferConfig(groups_per_step=2), pusher=share,
                      device_share=share, registry=registry)
    trainer.start(ctx=ctx)
    original_save = trainer.checkpointer.save

    def save_recorded(*args, **kwargs):
        events.append("checkpoint")
        return original_save(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpointer, "save", save_recorded)
    for seed in range(3):
        record = trainer.train(synthetic_groups(seed, 2))
        assert record["offload_s"] >= 0 and record["onload_s"] >= 0
    trainer.save_checkpoint()  # as finish() does after the last step: the memory comes back for it
    trainer.close()
    for stage in ("wait", "onload", "offload"):
        count = registry.get_sample_value("rollwave_trainer_device_handover_seconds_count", {"stage": stage})
        assert count == 3, (stage, count)
    assert events == ["offload", "give 0",
                      "take 1", "onload", "offload", "give 1",
                      "take 2", "onload", "checkpoint", "offload", "give 2",
                      "take 3", "onload", "offload", "give 3",
                      "onload", "checkpoint", "offload"], events
