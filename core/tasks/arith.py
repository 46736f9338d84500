"""Procedural multi-step arithmetic word problems: the tiny model's tool-use task.

Ten templates with 2-4 digit numbers and 2-3 operations, so the exact answer needs the calculator.
On four templates a plausible wrong formula exists (``a+b*c`` for ``(a+b)*c``...): the SFT warm start
uses it in a share of its demonstrations, which gives RL a wrong *choice* the policy can already sample
and learn away (a measured set-up: RL lifts held-out accuracy where continued SFT does not).

Splits are disjoint by construction: a problem (template + numbers) belongs to ``test`` when a hash of it
falls in one bucket in ten and to ``train`` otherwise; each split draws from its own seeded stream and
rejects problems of the other split, so no train problem ever appears in test, for any seed or limit.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from core.tasks.base import SYSTEM_PROMPT, Task, gold_tools_kwargs, window

CALCULATOR_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*4"}},
            "required": ["expression"],
        },
    },
}

SPLITS = ("train", "test")
DEFAULT_LIMIT = 1000
# the stream is made from its start, about 70 us a task: a job or `rollwave rollout --index` past this would hold
# its caller (an API request, say) for minutes and its memory with it
MAX_STREAM = 200_000
_TEST_BUCKETS = 10  # one problem in ten is a test problem

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Kara", "Leo")


@dataclass(frozen=True)
class Template:
    """One problem type: text with ``{a}..{d}`` and ``{name}``, slot ranges, and formulas over the slots."""

    id: str
    text: str
    slots: dict[str, tuple[int, int]]
    formula: str
    wrong_formula: str | None = None


TEMPLATES: tuple[Template, ...] = (
    Template(
        "farm",
        "A farm has {a} cows and {b} sheep. Each animal eats {c} kg of hay a week. "
        "How many kg of hay do they eat in a week?",
        {"a": (10, 999), "b": (10, 999), "c": (10, 99)},
        "(a+b)*c",
        "a+b*c",
    ),
    Template(
        "bakery",
        "{name} baked {a} cookies and burned {b} of them. {name} sells the rest for {c} cents each. "
        "How many cents does {name} earn?",
        {"a": (100, 9999), "b": (10, 99), "c": (10, 99)},
        "(a-b)*c",
        "a-b*c",
    ),
    Template(
        "hotel",
        "A hotel has {a} floors. Each floor has {b} single rooms and {c} double rooms. "
        "How many rooms does the hotel have?",
        {"a": (10, 99), "b": (10, 99), "c": (10, 99)},
        "a*(b+c)",
        "a*b+c",
    ),
    Template(
        "marbles",
        "{name} has {a} marbles and wins {b} more each day for {c} days. "
        "How many marbles does {name} have now?",
        {"a": (100, 9999), "b": (10, 99), "c": (10, 99)},
        "a+b*c",
        "(a+b)*c",
    ),
    Template(
        "pens",
        "A shop has {a} boxes with {b} pens in each box. It sells {c} pens. How many pens are left?",
        {"a": (10, 999), "b": (10, 99), "c": (10, 999)},
        "a*b-c",
    ),
    Template(
        "tickets",
        "{name} buys {a} tickets at {b} dollars each and {c} snacks at {d} dollars each. "
        "How many dollars does {name} spend?",
        {"a": (10, 99), "b": (10, 99), "c": (10, 99), "d": (10, 99)},
        "a*b+c*d",
    ),
    Template(
        "library",
        "A library has {a} novels, {b} comics and {c} shelves with {d} magazines on each. "
        "How many items does it have?",
        {"a": (100, 9999), "b": (100, 999), "c": (10, 99), "d": (10, 99)},
        "a+b+c*d",
    ),
    Template(
        "truck",
        "A truck carries {a} crates. Each crate holds {b} bags and each bag holds {c} apples. "
        "How many apples are on the truck?",
        {"a": (10, 99), "b": (10, 99), "c": (10, 99)},
        "a*b*c",
    ),
    Template(
        "factory",
        "A factory makes {a} toys an hour for {b} hours. It ships {c} boxes of {d} toys. "
        "How many toys are left?",
        {"a": (100, 999), "b": (10, 99), "c": (10, 99), "d": (10, 99)},
        "a*b-c*d",
    ),
    Template(
        "bus",
        "{a} buses carry {b} people each. At the next stop {c} people get on and {d} get off. "
        "How many people are on the buses now?",
        {"a": (10, 99), "b": (10, 99), "c": (10, 999), "d": (10, 999)},
        "a*b+c-d",
    ),
)

_BINOPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}


def evaluate(expression: str) -> int:
    """Exact value of an integer expression with ``+ - *`` and parentheses (the formulas above)."""

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


def _substitute(formula: str, numbers: dict[str, int]) -> str:
    return re.sub(r"[a-d]", lambda m: str(numbers[m.group()]), formula)


def _split_of(template: Template, numbers: dict[str, int]) -> str:
    key = template.id + "|" + ",".join(f"{k}={numbers[k]}" for k in sorted(numbers))
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % _TEST_BUCKETS
    return "test" if bucket == 0 else "train"


def generate(split: str = "train", *, limit: int | None = None, seed: int = 0, offset: int = 0) -> list[Task]:
    """Tasks ``offset .. offset+limit`` of the seeded stream of ``split`` (no duplicates within a split)."""
    if split not in SPLITS:
        raise ValueError(f"arith: unknown split {split!r}; valid: {', '.join(SPLITS)}")
    count = offset + (DEFAULT_LIMIT if limit is None else limit)
    if count > MAX_STREAM:
        raise ValueError(f"arith: offset + limit = {count} is past the first {MAX_STREAM} tasks of a split this "
                         "generator makes (a jsonl file holds as many as you like)")
    rng = random.Random(f"rollwave-arith/{split}/{seed}")
    seen: set[tuple[str, tuple[int, ...]]] = set()
    tasks: list[Task] = []
    while len(tasks) < count:
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        numbers = {slot: rng.randint(lo, hi) for slot, (lo, hi) in template.slots.items()}
        name = NAMES[rng.randrange(len(NAMES))]
        answer = evaluate(_substitute(template.formula, numbers))
        key = (template.id, tuple(numbers.values()))
        if answer <= 0 or key in seen or _split_of(template, numbers) != split:
            continue
        seen.add(key)
        tasks.append(_task(template, numbers, name, answer, split, seed, len(tasks)))
    return window(tasks, offset, limit if limit is not None else DEFAULT_LIMIT)


def _task(
    template: Template, numbers: dict[str, int], name: str, answer: int, split: str, seed: int, index: int
) -> Task:
    gold = str(answer)
    wrong = _substitute(template.wrong_formula, numbers) if template.wrong_formula else None
    return Task(
        task_id=f"arith-{split}-{seed}-{index}",
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": template.text.format(name=name, **numbers)},
        ],
        tools=["calculator"],
        tools_kwargs=gold_tools_kwargs(gold),
        reward={"kind": "gsm8k", "ground_truth": gold},
        meta={
            "source": "arith",
            "split": split,
            "template": template.id,
            "numbers": numbers,
            "expression": _substitute(template.formula, numbers),
            "wrong_expression": wrong,
        },
    )


def demonstration(task: Task, rng: random.Random, wrong_formula_rate: float = 0.7) -> list[dict[str, Any]]:
    """The prompt plus a full solution: a calculator call, its exact result, then "The answer is N.".

    Where the task's template has a wrong formula, it is used with probability ``wrong_formula_rate``
    (and the answer is then that formula's value): the flawed warm start that RL has to correct.
    """
    if task.meta.get("source") != "arith":
        raise ValueError(f"{task.task_id}: demonstrations exist only for arith tasks")
    if not 0.0 <= wrong_formula_rate <= 1.0:
        raise ValueError(f"wrong_formula_rate must be in [0, 1], got {wrong_formula_rate}")
    expression = task.meta["expression"]
    wrong = task.meta.get("wrong_expression")
    if wrong and rng.random() < wrong_formula_rate:
        expression = wrong
    value = evaluate(expression)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        *task.messages,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": str(value)},
        {"role": "assistant", "content": f"The answer is {value}."},
    ]
