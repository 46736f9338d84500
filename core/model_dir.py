"""A run's model directory: one that holds a model and its tokenizer, or the tiny model built into it.

Apart from ``core.tiny_model`` so that a component that only checks its model directory (a rollout server,
``rollwave up``) does not import the builder's torch and transformers model classes to start.
"""

from __future__ import annotations

from pathlib import Path

from core.config import ConfigError, ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def missing_tokenizer(model_dir: Path) -> str | None:
    """Why ``model_dir`` has no tokenizer, or None. Without one, transformers falls back to a one-token
    vocabulary that encodes every prompt as nothing, and a run would train on empty episodes."""
    if any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    return f"{model_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"


def ensure_model(cfg: ModelConfig) -> Path:
    """The model directory of a run config, built (the tiny model) when missing and ``init_if_missing``."""
    if not (cfg.path / "config.json").exists():
        if not cfg.init_if_missing:
            raise ConfigError(f"model.path: {cfg.path} holds no model (config.json) and init_if_missing is off: "
                              f"point it at an HF model directory, or build the tiny model there (`rollwave model "
                              f"init --out {cfg.path}`)")
        from core.tiny_model import build_tiny_model  # torch and transformers: only to build one

        build_tiny_model(cfg.path, seed=cfg.seed)
    if (why := missing_tokenizer(cfg.path)) is not None:
        raise ConfigError(f"model.path: {why}")
    return cfg.path
