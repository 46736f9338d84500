"""The task contract and the file plumbing every file-backed source shares.

A ``Task`` is what the API enqueues and one rollout worker turns into one trajectory group:
the prompt (OpenAI chat messages), the tools offered, per-tool kwargs (verl style) and the reward spec.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import closing
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from core.text_files import utf8_lines

# Shared by every built-in source and by the tokenizer corpus; short, because the tiny model's context is.
SYSTEM_PROMPT = "Use the calculator for arithmetic. End with: The answer is N."

T = TypeVar("T")

# A split names the file ``{split}.jsonl`` in a source's directory: no separator, and not ``.`` or ``..``.
_SPLIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}", re.ASCII)
# A task id is in every group, sample and log line of its task, and in Redis keys: an id, not a payload.
MAX_TASK_ID_CHARS = 512


class Task(BaseModel):
    """One prompt to roll out: the contract between task sources, the task queue and the agent loop.

    ``tools`` names the tools offered; ``tools_kwargs`` is verl's per-tool dict, e.g.
    ``{"check_answer": {"create_kwargs": {"ground_truth": "42"}}}``; ``reward`` is the reward spec,
    e.g. ``{"kind": "gsm8k", "ground_truth": "42"}``; ``meta`` is for inspection and the SFT demonstrations.
    """

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field(min_length=1, max_length=MAX_TASK_ID_CHARS)
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[str] = Field(default_factory=list)
    tools_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    reward: dict[str, Any]
    meta: dict[str, Any] = Field(default_factory=dict)


def gold_tools_kwargs(ground_truth: str) -> dict[str, dict[str, Any]]:
    """Per-tool kwargs that hand the gold answer to a ``check_answer`` tool, if the tool config offers one."""
    return {"check_answer": {"create_kwargs": {"ground_truth": ground_truth}}}


def check_split(split: str | None) -> str | None:
    """``split`` unchanged if it is a plain name: it becomes part of a path, so ``../x`` would read another file."""
    if split is not None and not _SPLIT.fullmatch(split):
        raise ValueError(
            f"split {split!r} is not a plain name (letters, digits, '_', '-' and '.', not first; no path)"
        )
    return split


def split_file(source: str, path: str | None, split: str | None, root: Path | None = None) -> Path:
    """``path`` itself if it is a file, else ``path/{split}.jsonl`` (split defaults to ``train``, and must be a
    plain name: ``check_split``).

    With ``root`` (the API's ``api.data_root``) a relative ``path`` is read under ``root``, and the file,
    symlinks resolved, must lie under it: a job cannot make the API read any other file on its host.
    """
    check_split(split)
    if path is None:
        raise ValueError(
            f"task source {source!r} needs a path: a .jsonl file or a directory of {{split}}.jsonl"
        )
    p = Path(path) if root is None else Path(root) / path
    if p.is_dir():
        p = p / f"{split or 'train'}.jsonl"
    if root is not None and not p.resolve().is_relative_to(Path(root).resolve()):
        raise ValueError(f"task source {source!r}: {str(p)!r} lies outside the data root {root}")
    if not p.is_file():
        raise FileNotFoundError(f"task source {source!r}: no such file: {p}")
    return p


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, row)`` per non-blank line; a line that is not a JSON object is a ValueError."""
    with path.open("rb") as f:
        for lineno, line in utf8_lines(f, path):  # a line that is not UTF-8: TextFileError (a ValueError)
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def field(row: dict[str, Any], key: str, kind: type[T], where: str, *, label: str | None = None) -> T:
    """``row[key]``, present and of type ``kind``; the error names ``file:line`` and the field."""
    name = label or key
    if key not in row:
        raise ValueError(f"{where}: missing field {name!r}")
    value = row[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def read_window(file: Path, offset: int, limit: int | None, make: Callable[[int, dict[str, Any]], T]) -> list[T]:
    """Rows ``offset .. offset+limit`` of a jsonl file, each made by ``make(line, row)``, which checks it (its error
    names ``file:line``). Reading stops once the last of them is taken, so a job's ``limit`` bounds what a large file
    costs: the rows before ``offset`` are read and checked but not kept, the rows after the window are never read.
    An empty file or an ``offset`` past its last row is an error naming the file, not an empty job."""
    _check_window(offset, limit)
    taken: list[T] = []
    rows = 0
    stop = None if limit is None else offset + max(limit, 1)  # limit 0 reads the row at offset too: there must be one
    with closing(read_jsonl(file)) as lines:
        for line, row in islice(lines, stop):
            item = make(line, row)
            if rows >= offset:
                taken.append(item)
            rows += 1
    if not rows:
        raise ValueError(f"{file}: no rows")
    if offset >= rows:
        raise ValueError(f"offset {offset} is past the {rows} row{'' if rows == 1 else 's'} of {file}")
    return taken[:limit]


def window(items: list[T], offset: int, limit: int | None) -> list[T]:
    """``items[offset : offset + limit]`` after checking both."""
    _check_window(offset, limit)
    return items[offset:] if limit is None else items[offset : offset + limit]


def _check_window(offset: int, limit: int | None) -> None:
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
