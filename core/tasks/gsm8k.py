"""GSM8K from its jsonl files (``question``; ``answer`` with ``<<a*b=c>>`` annotations, ending ``#### N``).

Read from disk only: nothing is downloaded. Without a path, the copy the repository carries in
``data/gsm8k/`` (MIT, from openai/grade-school-math) is read. The gold is the number after ``####``
with commas removed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from core.tasks.base import SYSTEM_PROMPT, Task, field, gold_tools_kwargs, read_window, split_file

_GOLD = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")
_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
# Found from this file, not the working directory, so any command run from anywhere in a checkout finds it.
BUNDLED = Path(__file__).resolve().parents[2] / "data" / "gsm8k"


def load(
    path: str | None,
    split: str | None = None,
    *,
    limit: int | None = None,
    offset: int = 0,
    root: Path | None = None,
) -> list[Task]:
    """Rows ``offset .. offset+limit``, read no further (``read_window``): every row read is validated (a bad one
    fails loudly, naming ``file:line``).

    ``path`` None reads the bundled ``data/gsm8k/{split}.jsonl``, which must lie under ``BUNDLED`` as a ``path``
    must under ``root``: the API reads it for any job.
    """
    file = split_file("gsm8k", path, split, root) if path else split_file("gsm8k", str(BUNDLED), split, BUNDLED)
    name = split or file.stem

    def make(line: int, row: dict[str, Any]) -> Task:
        where = f"{file}:{line}"
        question = field(row, "question", str, where)
        answer = field(row, "answer", str, where)
        match = _GOLD.search(answer)
        if match is None:
            raise ValueError(f"{where}: field 'answer' does not end with '#### <number>'")
        gold = match.group(1).replace(",", "")
        return Task(
            task_id=f"gsm8k-{name}-{line}",
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            tools=["calculator"],
            tools_kwargs=gold_tools_kwargs(gold),
            reward={"kind": "gsm8k", "ground_truth": gold},
            meta={
                "source": "gsm8k",
                "file": str(file),
                "line": line,
                "solution": answer,
                "calculations": [f"{lhs}={rhs}" for lhs, rhs in _ANNOTATION.findall(answer)],
            },
        )

    return read_window(file, offset, limit, make)
