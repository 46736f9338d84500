"""GSM8K answer matching on the real test set, tool rewards, and custom reward functions by import path."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from typing import Any

import pytest
from pydantic import ValidationError

from core.config import ConfigError, load_config
from core.jobs import JobSpec
from core.rewards import RewardComputer, RewardError, extract_answer, gsm8k_reward, load_reward_fn
from core.tasks import Task
from core.tasks.gsm8k import BUNDLED

GSM8K_TEST = BUNDLED / "test.jsonl"


def _gsm8k_items() -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in GSM8K_TEST.read_text().splitlines() if line.strip()]
    return [(row["answer"], row["answer"].split("####")[-1].strip()) for row in rows]


def _changed(number: str) -> str:
    """The gold number plus one, written the same way (commas kept where the value allows)."""
    value = int(number.replace(",", "")) + 1
    return f"{value:,}" if "," in number else str(value)


def test_gsm8k_gold_answer_scores_one_and_a_changed_number_zero() -> None:
    items = _gsm8k_items()
    assert len(items) == 1319
    for solution, gold in items:
        for mode in ("strict", "flexible"):
            assert gsm8k_reward(solution, gold, mode) == 1.0, (mode, solution)
            wrong = re.sub(r"####\s*.*$", f"#### {_changed(gold)}", solution)
            assert gsm8k_reward(wrong, gold, mode) == 0.0, (mode, wrong)


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("so 5 + 7 = 12\n#### 12", "12", "12"),
        ("It is \\boxed{1,234} dollars, 7 extra.", None, "1,234"),
        ("Total: 3 apples. The answer is $1,600.", None, "$1,600"),
        ("The Answer is: -3. Check: 1 2", None, "-3"),
        ("first 10, then 12 - 3", None, "3"),
        ("no digits here", None, None),
    ],
)
def test_extraction_strict_and_flexible(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_a_long_run_of_spaces_after_answer_is_is_read_at_once() -> None:
    """The flexible pattern split the spaces after ``answer is`` in quadratically many ways before failing on what
    follows them: 16000 took 3 s of the rollout server's event loop (and a tool call can send such a text at each of
    its turns), 200000 would take 20 min. It now reads them once; the gap with a colon still matches. (In a process
    of its own: a match holds the GIL, so no thread could time it out.)"""
    texts = ["answer is" + " " * 200_000 + "x", "The answer is \t : \n 42", "answer is :7", "answer is: 7"]
    script = ("import json, sys; from core.rewards import extract_answer as e; "
              "print(json.dumps([e(t) for t in json.load(sys.stdin)]))")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(texts), capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(done.stdout) == [None, "42", "7", "7"]


def test_numbers_compare_as_values() -> None:
    assert gsm8k_reward("#### 1600.0", "1,600") == 1.0
    assert gsm8k_reward("The answer is 18.", "18") == 1.0
    assert gsm8k_reward("The answer is 18.5", "18") == 0.0
    assert gsm8k_reward("The answer is 18", "18", mode="strict") == 0.0
    assert gsm8k_reward("The answer is \u22125.", "-5") == 1.0  # U+2212, the typeset minus sign
    assert gsm8k_reward("#### \u22125", "5") == 0.0
    with pytest.raises(ValueError, match="mode"):
        extract_answer("1", "loose")
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("#### 1", "abc")


def _task(**reward: Any) -> Task:
    return Task(task_id="t1", messages=[{"role": "user", "content": "q"}], reward=reward)


async def good_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return 0.5, {"len": len(final_text)}


async def float_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return 2


async def broken_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    raise RuntimeError("judge is down")


async def garbage_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    return "high"


def sync_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    return 1.0


async def hanging_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]) -> float:
    """A judge that never answers."""
    await asyncio.Event().wait()
    return 1.0


async def judge_timeout_reward(task: Task, messages: list[dict], final_text: str, tool_rewards: list[float]):
    """A judge whose own HTTP client gives up at once."""
    raise TimeoutError("judge.example: read timed out")


ALLOWLIST = {name: f"{__name__}:{name}" for name in ("good_reward", "float_reward", "broken_reward",
                                                      "garbage_reward", "sync_reward", "hanging_reward",
                                                      "judge_timeout_reward")}


def _score(spec: str, task: Task, text: str = "", tool_rewards: list[float] | None = None, **limits: float):
    """(the score, None), or (None, the RewardError's message) when the function failed."""
    computer = RewardComputer(spec, allowlist=ALLOWLIST, **limits)
    try:
        return asyncio.run(computer.score(task, [], text, tool_rewards or [])), None
    except RewardError as exc:
        return None, str(exc)


def test_builtin_gsm8k_and_tool_rewards() -> None:
    (reward, info), error = _score("gsm8k", _task(kind="gsm8k", ground_truth="42"), "The answer is 42.")
    assert (reward, info["extracted"], error) == (1.0, "42", None)
    (reward, _), _ = _score(
        "gsm8k", _task(kind="gsm8k", ground_truth="42", mode="strict"), "The answer is 42."
    )
    assert reward == 0.0
    assert _score("tool", _task(), tool_rewards=[0.0, 1.0, 0.0])[0] == (
        1.0,
        {"tool_rewards": [0.0, 1.0, 0.0]},
    )
    assert _score("tool_last", _task(), tool_rewards=[1.0, 0.0])[0][0] == 0.0
    assert _score("tool", _task())[0][0] == 0.0
    # a task may pick another built-in; the config's default applies otherwise
    assert _score("gsm8k", _task(kind="tool"), tool_rewards=[1.0])[0][0] == 1.0


def test_custom_reward_by_allowlisted_name() -> None:
    assert _score("good_reward", _task(), "abc")[0] == (0.5, {"len": 3})
    assert _score("float_reward", _task())[0] == (2.0, {})


def test_failing_rewards_raise_a_reward_error_never_a_made_up_zero() -> None:
    assert _score("broken_reward", _task()) == (None, "RuntimeError: judge is down")
    assert "want a float" in _score("garbage_reward", _task())[1]
    assert "no ground_truth" in _score("gsm8k", _task(kind="gsm8k"))[1]
    assert "not a built-in" in _score("gsm8k", _task(kind="os:system"))[1]


def test_a_hanging_reward_fails_naming_the_reward_task_and_limit() -> None:
    """A judge that never answers is cancelled at the limit: the episode fails rather than holding its group's
    lease forever. A timeout of the judge's own is its error, not a claim that the limit was reached."""
    start = time.monotonic()
    assert _score("hanging_reward", _task(), timeout_s=0.2) == (
        None, "reward 'hanging_reward' for task t1: no answer within 0.2s (rollout.reward_timeout_s)"
    )
    assert 0.2 <= time.monotonic() - start < 2
    assert _score("judge_timeout_reward", _task(), timeout_s=30) == (
        None, "TimeoutError: judge.example: read timed out"
    )
    assert _score("good_reward", _task(), "ab", timeout_s=0.2)[0] == (0.5, {"len": 2})


def test_bad_reward_specs_are_rejected_up_front() -> None:
    with pytest.raises(ValueError, match="nor in rollout.reward_allowlist"):
        load_reward_fn("nonsense", ALLOWLIST)
    with pytest.raises(ValueError, match="cannot import"):
        load_reward_fn("gone", {"gone": "no_such_module_xyz:fn"})
    with pytest.raises(ValueError, match="async"):
        load_reward_fn("sync_reward", ALLOWLIST)


def test_only_the_operator_allowlist_imports_code() -> None:
    """An import path is never a reward name: not for a job, not for the server, not without the allowlist."""
    for name in ("os:system", f"{__name__}:good_reward", "good_reward"):
        with pytest.raises(ValueError, match="not a built-in"):
            load_reward_fn(name)
    with pytest.raises(ValidationError, match="never an import path"):
        JobSpec(source={"kind": "arith", "limit": 1}, reward="os:system")
    assert JobSpec(source={"kind": "arith", "limit": 1}, reward="good_reward").reward == "good_reward"
    with pytest.raises(ConfigError, match="rollout.reward_allowlist"):
        load_config(None, ["rollout.reward=good_reward"])
    with pytest.raises(ConfigError, match="not a built-in"):
        load_config(None, ["rollout.reward_allowlist={gsm8k: os:system}"])
    with pytest.raises(ConfigError, match="not module:function"):
        load_config(None, ["rollout.reward_allowlist={mine: os.system}"])
    cfg = load_config(None, [f"rollout.reward_allowlist={{good_reward: '{__name__}:good_reward'}}",
                             "rollout.reward=good_reward"])
    assert asyncio.run(RewardComputer(cfg.rollout.reward, allowlist=cfg.rollout.reward_allowlist).score(
        _task(), [], "abcd", [])) == (0.5, {"len": 4})
