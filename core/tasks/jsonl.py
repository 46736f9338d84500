"""Generic tasks in verl's parquet-row style, one JSON object per line.

``{"prompt": [messages], "tools_kwargs": {...}, "reward_model": {"ground_truth": ..., "style": "rule"},
"data_source": ..., "extra_info": {...}}``. ``messages`` is accepted for ``prompt``; ``tools_kwargs`` may also
sit in ``extra_info`` (where verl puts it); ``tools`` (names) defaults to the keys of ``tools_kwargs``;
``reward_model`` may name a ``kind`` (a built-in reward, or the job's function); without one the job's reward
function scores the row (its ``reward``, else the run's ``rollout.reward``, gsm8k by default), as verl's rows
carry none. It is checked against the function that will score the row (a gsm8k ``ground_truth`` must be a
number...: ``core.tasks.check``). The task id is ``id``, else ``jsonl-{file}-{extra_info.index}``, else
``jsonl-{file}-{line}``. An empty file, or an ``offset`` past its last row, is an error naming the file; rows past
``offset + limit`` are not read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.tasks.base import MAX_TASK_ID_CHARS, Task, field, read_window, split_file
from core.tasks.check import check_task
from core.text_files import json_path, lone_surrogate_at


def load(
    path: str | None,
    split: str | None = None,
    *,
    limit: int | None = None,
    offset: int = 0,
    root: Path | None = None,
    reward: str | None = None,
) -> list[Task]:
    """Rows ``offset .. offset+limit``, read no further (``read_window``): every row read is validated (a bad one
    fails loudly, naming ``file:line``), and no two rows read may share a task id.

    ``reward`` is the job's reward function, when known: a row's reward spec is checked against the function
    that will score it (``core.tasks.check``).
    """
    file = split_file("jsonl", path, split, root)
    first_line: dict[str, int] = {}

    def make(line: int, row: dict[str, Any]) -> Task:
        where = f"{file}:{line}"
        task = _task(row, file, line, where, reward)
        if task.task_id in first_line:
            first = first_line[task.task_id]
            raise ValueError(f"{where}: duplicate task id {task.task_id!r} (first on line {first})")
        first_line[task.task_id] = line
        return task

    return read_window(file, offset, limit, make)


def _task(row: dict[str, Any], file: Path, line: int, where: str, reward: str | None) -> Task:
    if (at := lone_surrogate_at(row)) is not None:  # JSON's "\ud800" escape: every rollout of the row would fail
        place = json_path(at).encode("utf-8", "backslashreplace").decode() or "the row"
        raise ValueError(f"{where}: field '{place}' holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not "
                         "paired), which is no character: no tokenizer takes it")
    key = "prompt" if "prompt" in row or "messages" not in row else "messages"
    messages = field(row, key, list, where)
    extra = field(row, "extra_info", dict, where) if "extra_info" in row else {}
    holder, kwargs_label = (row, "tools_kwargs") if "tools_kwargs" in row else (extra, "extra_info.tools_kwargs")
    tools_kwargs = field(holder, "tools_kwargs", dict, where, label=kwargs_label) if "tools_kwargs" in holder else {}
    tools = field(row, "tools", list, where) if "tools" in row else list(tools_kwargs)
    reward_model = field(row, "reward_model", dict, where)
    if "ground_truth" not in reward_model:
        raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    check_task(
        messages=messages, tools=tools, tools_kwargs=tools_kwargs, reward_spec=reward_model, where=where,
        labels={"messages": key, "tools": "tools", "tools_kwargs": kwargs_label, "reward": "reward_model"},
        reward=reward,
    )
    if "id" in row:
        raw = row["id"]
        if isinstance(raw, bool) or not isinstance(raw, str | int) or raw == "":
            raise ValueError(f"{where}: field 'id' must be a non-empty string or an integer")
        task_id = str(raw)
        if len(task_id) > MAX_TASK_ID_CHARS:
            raise ValueError(f"{where}: field 'id' is {len(task_id)} characters long; at most {MAX_TASK_ID_CHARS}")
    elif "index" in extra:
        task_id = f"jsonl-{file.stem}-{field(extra, 'index', int, where, label='extra_info.index')}"
    else:
        task_id = f"jsonl-{file.stem}-{line}"
    return Task(
        task_id=task_id,
        messages=messages,
        tools=tools,
        tools_kwargs=tools_kwargs,
        reward=reward_model,
        meta={
            "source": "jsonl",
            "file": str(file),
            "line": line,
            "data_source": row.get("data_source"),
            "extra_info": extra,
        },
    )
