"""Generic tasks in verl's parquet-row style, one JSON object per line.

``{"prompt": [messages], "tools_kwargs": {...}, "reward_model": {"ground_truth": ..., "style": "rule"},
"data_source": ..., "extra_info": {...}}``. ``messages`` is accepted for ``prompt``; ``tools_kwargs`` may also
sit in ``extra_info`` (where verl puts it); ``tools`` (names) defaults to the keys of ``tools_kwargs``;
``reward_model`` may name a ``kind`` (default ``gsm8k``). The task id is ``id``, else
``jsonl-{file}-{extra_info.index}``, else ``jsonl-{file}-{line}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.tasks.base import Task, field, read_jsonl, split_file, window

_ROLES = ("system", "user", "assistant", "tool")


def load(
    path: str | None,
    split: str | None = None,
    *,
    limit: int | None = None,
    offset: int = 0,
    root: Path | None = None,
) -> list[Task]:
    """Every row is validated (a bad row anywhere fails loudly), then ``offset``/``limit`` pick the window."""
    file = split_file("jsonl", path, split, root)
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    for line, row in read_jsonl(file):
        where = f"{file}:{line}"
        task = _task(row, file, line, where)
        if task.task_id in first_line:
            first = first_line[task.task_id]
            raise ValueError(f"{where}: duplicate task id {task.task_id!r} (first on line {first})")
        first_line[task.task_id] = line
        tasks.append(task)
    return window(tasks, offset, limit)


def _messages(row: dict[str, Any], where: str) -> list[dict[str, Any]]:
    key = "prompt" if "prompt" in row or "messages" not in row else "messages"
    messages = field(row, key, list, where)
    if not messages:
        raise ValueError(f"{where}: field {key!r} is empty")
    for i, message in enumerate(messages):
        label = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: field {label!r} must be an object, got {type(message).__name__}")
        role = field(message, "role", str, where, label=f"{label}.role")
        if role not in _ROLES:
            raise ValueError(f"{where}: field '{label}.role' is {role!r}; valid: {', '.join(_ROLES)}")
        field(message, "content", str, where, label=f"{label}.content")
    return messages


def _tools_kwargs(row: dict[str, Any], extra: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    holder, label = (row, "tools_kwargs") if "tools_kwargs" in row else (extra, "extra_info.tools_kwargs")
    kwargs = field(holder, "tools_kwargs", dict, where, label=label) if "tools_kwargs" in holder else {}
    for name, value in kwargs.items():
        if not isinstance(value, dict):
            raise ValueError(f"{where}: field '{label}.{name}' must be dict, got {type(value).__name__}")
    return kwargs


def _task(row: dict[str, Any], file: Path, line: int, where: str) -> Task:
    messages = _messages(row, where)
    extra = field(row, "extra_info", dict, where) if "extra_info" in row else {}
    tools_kwargs = _tools_kwargs(row, extra, where)
    if "tools" in row:
        tools = field(row, "tools", list, where)
        for i, name in enumerate(tools):
            if not isinstance(name, str):
                raise ValueError(f"{where}: field 'tools[{i}]' must be str, got {type(name).__name__}")
    else:
        tools = list(tools_kwargs)
    reward_model = field(row, "reward_model", dict, where)
    if "ground_truth" not in reward_model:
        raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    kind = reward_model.get("kind", "gsm8k")
    if not isinstance(kind, str):
        raise ValueError(f"{where}: field 'reward_model.kind' must be str, got {type(kind).__name__}")
    if "id" in row:
        raw = row["id"]
        if isinstance(raw, bool) or not isinstance(raw, str | int) or raw == "":
            raise ValueError(f"{where}: field 'id' must be a non-empty string or an integer")
        task_id = str(raw)
    elif "index" in extra:
        task_id = f"jsonl-{file.stem}-{field(extra, 'index', int, where, label='extra_info.index')}"
    else:
        task_id = f"jsonl-{file.stem}-{line}"
    return Task(
        task_id=task_id,
        messages=messages,
        tools=tools,
        tools_kwargs=tools_kwargs,
        reward={**reward_model, "kind": kind},
        meta={
            "source": "jsonl",
            "file": str(file),
            "line": line,
            "data_source": row.get("data_source"),
            "extra_info": extra,
        },
    )
