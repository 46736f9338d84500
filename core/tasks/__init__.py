"""Task sources: where prompts come from. ``load_tasks`` picks one by name."""

from __future__ import annotations

from pathlib import Path

from core.tasks.base import SYSTEM_PROMPT, Task

SOURCES = ("arith", "gsm8k", "jsonl")

__all__ = ["SOURCES", "SYSTEM_PROMPT", "Task", "load_tasks"]


def load_tasks(
    source: str,
    *,
    path: str | None = None,
    split: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    offset: int = 0,
    root: Path | None = None,
    reward: str | None = None,
) -> list[Task]:
    """Tasks ``offset .. offset+limit`` of a source.

    ``arith`` is generated (``split`` train|test, ``seed`` picks the stream, ``limit`` defaults to 1000);
    ``gsm8k`` and ``jsonl`` read ``path`` (a file, or a directory holding ``{split}.jsonl``) in file order, no
    further than row ``offset + limit``, and ignore ``seed`` (a job that sets one is refused: ``core.jobs``);
    ``gsm8k`` without a path reads the repository's ``data/gsm8k``; with ``root``, ``path`` is read under it and
    may not lead out of it. An empty file, or an ``offset`` past its last row, is an error.

    ``reward`` is the reward function the tasks will be scored with, when known (the job's ``reward``, else the
    run's ``rollout.reward``): a ``jsonl`` row's reward spec is checked against it (``core.tasks.check``); None
    checks what holds whatever the function (a built-in ``kind``), and takes another ``kind`` to be the run's.
    """
    if source == "arith":
        from core.tasks import arith

        return arith.generate(split or "train", limit=limit, seed=seed, offset=offset)
    if source == "gsm8k":
        from core.tasks import gsm8k

        return gsm8k.load(path, split, limit=limit, offset=offset, root=root)
    if source == "jsonl":
        from core.tasks import jsonl

        return jsonl.load(path, split, limit=limit, offset=offset, root=root, reward=reward)
    raise ValueError(f"unknown task source {source!r}; valid: {', '.join(SOURCES)}")
