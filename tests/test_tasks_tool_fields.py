"""Task loading: rows whose tool fields no episode could use are refused where they are read, naming the
file, the line and the field, not at every episode's tool create (which fails the task until it is dead-lettered)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.tasks import load_tasks
from core.tasks.base import Task
from core.tasks.check import check_inline

OK = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({**OK, "tools_kwargs": {"check_answer": {"create_kwargs": ["1"]}}},
         "field 'tools_kwargs.check_answer.create_kwargs' must be dict, got list"),
        ({**OK, "extra_info": {"tools_kwargs": {"check_answer": {"create_kwargs": "1"}}}},
         "field 'extra_info.tools_kwargs.check_answer.create_kwargs' must be dict, got str"),
        ({**OK, "tools": ["calculator", "check_answer", "calculator"]},
         "field 'tools[2]': tool 'calculator' is named twice (first at tools[0])"),
    ],
)
def test_tool_fields_no_episode_could_use_name_file_line_and_field(tmp_path: Path, row: dict, message: str) -> None:
    """``create_kwargs`` reach the tool's create as keyword arguments, so they must be a mapping; a tool named twice
    would get two instances per episode, of which the episode knows (and releases) one."""
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (OK, row)) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
        load_tasks("jsonl", path=str(path))


def test_inline_tasks_get_the_same_tool_checks() -> None:
    task = Task(task_id="a", messages=OK["prompt"], tools=["calculator", "calculator"], reward={"ground_truth": "1"})
    with pytest.raises(ValueError, match=re.escape("field 'source.tasks[0].tools[1]': tool 'calculator' is named "
                                                   "twice (first at source.tasks[0].tools[0])")):
        check_inline([task])
