"""Task sources: seeded arith problems and demonstrations, GSM8K and verl-style jsonl files, bad input."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from core.rewards import RewardComputer
from core.tasks import SOURCES, Task, load_tasks
from core.tasks.arith import TEMPLATES, demonstration, evaluate
from core.tasks.gsm8k import BUNDLED


def _write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_unknown_source_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: arith, gsm8k, jsonl"):
        load_tasks("mmlu")
    assert SOURCES == ("arith", "gsm8k", "jsonl")


def test_arith_is_seeded_and_exact() -> None:
    first = load_tasks("arith", limit=300, seed=7)
    assert [t.model_dump() for t in first] == [t.model_dump() for t in load_tasks("arith", limit=300, seed=7)]
    assert [t.messages for t in first] != [t.messages for t in load_tasks("arith", limit=300, seed=8)]
    assert len({t.task_id for t in first}) == 300 and first[5].task_id == "arith-train-7-5"
    assert {t.meta["template"] for t in first} == {t.id for t in TEMPLATES}
    for task in first:
        gold = task.reward["ground_truth"]
        assert task.reward == {"kind": "gsm8k", "ground_truth": gold}
        assert evaluate(task.meta["expression"]) == int(gold) > 0
        assert task.tools == ["calculator"]
        assert task.tools_kwargs == {"check_answer": {"create_kwargs": {"ground_truth": gold}}}
        assert [m["role"] for m in task.messages] == ["system", "user"]
        assert all(10 <= n <= 9999 for n in task.meta["numbers"].values())
    assert load_tasks("arith", limit=5, offset=10, seed=7) == first[10:15]
    assert len(load_tasks("arith")) == 1000


def test_arith_train_and_test_never_share_a_problem() -> None:
    train = load_tasks("arith", split="train", limit=4000)
    test = load_tasks("arith", split="test", limit=400)
    other_seed = load_tasks("arith", split="test", limit=400, seed=1)
    train_text = {t.messages[1]["content"] for t in train}
    train_math = {(t.meta["template"], tuple(t.meta["numbers"].values())) for t in train}
    for split in (test, other_seed):
        assert len({t.messages[1]["content"] for t in split}) == len(split)
        assert not train_text & {t.messages[1]["content"] for t in split}
        assert not train_math & {(t.meta["template"], tuple(t.meta["numbers"].values())) for t in split}
    assert test[0].task_id == "arith-test-0-0" and test[0].meta["split"] == "test"
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        load_tasks("arith", split="dev")


def test_demonstration_is_a_tool_call_result_and_answer() -> None:
    task = load_tasks("arith", limit=1)[0]
    chat = demonstration(task, random.Random(0), wrong_formula_rate=0.0)
    assert chat[:2] == task.messages
    call, result, final = chat[2:]
    assert call == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": task.meta["expression"]}},
            }
        ],
    }
    gold = task.reward["ground_truth"]
    assert result == {"role": "tool", "name": "calculator", "content": gold}
    assert final == {"role": "assistant", "content": f"The answer is {gold}."}


def test_wrong_formulas_appear_at_the_requested_rate_on_four_templates() -> None:
    tasks = load_tasks("arith", limit=2000, seed=3)
    rng = random.Random(0)
    wrong = Counter()
    for task in tasks:
        chat = demonstration(task, rng)
        expression = chat[2]["tool_calls"][0]["function"]["arguments"]["expression"]
        value = str(evaluate(expression))
        assert chat[3]["content"] == value and chat[4]["content"] == f"The answer is {value}."
        if expression != task.meta["expression"]:
            assert expression == task.meta["wrong_expression"]
            wrong[task.meta["template"]] += 1
    with_wrong = {t.id for t in TEMPLATES if t.wrong_formula}
    assert len(with_wrong) == 4 and set(wrong) == with_wrong
    eligible = sum(t.meta["template"] in with_wrong for t in tasks)
    assert 0.64 < sum(wrong.values()) / eligible < 0.76
    assert 0.22 < sum(wrong.values()) / len(tasks) < 0.34
    flawed = next(t for t in tasks if t.meta["wrong_expression"])
    always = demonstration(flawed, rng, wrong_formula_rate=1.0)
    assert (
        always[2]["tool_calls"][0]["function"]["arguments"]["expression"] == flawed.meta["wrong_expression"]
    )
    gsm = Task(task_id="x", messages=[{"role": "user", "content": "q"}], reward={"kind": "gsm8k"})
    with pytest.raises(ValueError, match="only for arith"):
        demonstration(gsm, rng)


def test_gsm8k_test_file_loads_with_its_gold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the bundled copy is found from the package, not the working directory
    tasks = load_tasks("gsm8k", split="test")
    assert len(tasks) == 1319 and len({t.task_id for t in tasks}) == 1319
    first = tasks[0]
    assert first.task_id == "gsm8k-test-1" and first.reward == {"kind": "gsm8k", "ground_truth": "18"}
    assert first.messages[1]["content"].startswith("Janet")
    assert first.meta["calculations"] == ["16-3-4=9", "9*2=18"]
    assert first.tools == ["calculator"]
    assert first.tools_kwargs["check_answer"]["create_kwargs"]["ground_truth"] == "18"
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", t.reward["ground_truth"]) for t in tasks)
    by_file = load_tasks("gsm8k", path=str(BUNDLED / "test.jsonl"), limit=3, offset=2)
    assert [t.model_dump() for t in by_file] == [t.model_dump() for t in tasks[2:5]]
    train = load_tasks("gsm8k")
    assert len(train) == 7473 and train[0].task_id == "gsm8k-train-1"


def test_gsm8k_strips_commas_and_reports_bad_rows(tmp_path: Path) -> None:
    good = {"question": "How many?", "answer": "It is <<1000+234=1234>>1,234.\n#### 1,234"}
    tasks = load_tasks("gsm8k", path=str(_write(tmp_path / "ok.jsonl", [good, "", good])))
    assert [t.reward["ground_truth"] for t in tasks] == ["1234", "1234"]
    assert [t.task_id for t in tasks] == ["gsm8k-ok-1", "gsm8k-ok-3"]

    bad_rows = {
        "{not json": "invalid JSON",
        json.dumps([1, 2]): "expected a JSON object",
        json.dumps({"answer": "#### 1"}): "missing field 'question'",
        json.dumps({"question": "q", "answer": 5}): "field 'answer' must be str",
        json.dumps(
            {"question": "q", "answer": "no marker"}
        ): "field 'answer' does not end with '#### <number>'",
    }
    for i, (row, message) in enumerate(bad_rows.items()):
        path = _write(tmp_path / f"bad{i}.jsonl", [good, row])
        with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
            load_tasks("gsm8k", path=str(path))

    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "valid.jsonl"))):
        load_tasks("gsm8k", path=str(tmp_path), split="valid")
    with pytest.raises(ValueError, match="needs a path"):
        load_tasks("jsonl")


def test_a_split_is_a_plain_name_and_the_bundled_copy_stays_under_its_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A split becomes ``{split}.jsonl`` in a directory: a ``../`` in it, or a symlink in the bundled copy (read for
    any job without a path, with no data root of the operator's), must not reach another file."""
    victim = _write(tmp_path / "victim.jsonl", [{"question": "secret?", "answer": "#### 1"}])
    escape = os.path.relpath(victim.with_suffix(""), BUNDLED)
    for source, path in (("gsm8k", None), ("gsm8k", str(tmp_path)), ("jsonl", str(tmp_path))):
        for split in (escape, "../victim", "..", ".", "a/b", "", "/etc/passwd"):
            with pytest.raises(ValueError, match="is not a plain name"):
                load_tasks(source, path=path, split=split)
    assert len(load_tasks("gsm8k", path=str(tmp_path), split="victim")) == 1  # a plain name is read as before
    bundled = tmp_path / "bundled"
    bundled.mkdir()
    (bundled / "test.jsonl").symlink_to(victim)
    monkeypatch.setattr("core.tasks.gsm8k.BUNDLED", bundled)
    with pytest.raises(ValueError, match="lies outside"):
        load_tasks("gsm8k", split="test")


def test_jsonl_reads_verl_rows(tmp_path: Path) -> None:
    verl = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "2+2?"}],
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {
            "index": 17,
            "tools_kwargs": {"calculator": {}, "check_answer": {"create_kwargs": {}}},
        },
    }
    alias = {
        "id": "mine",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "tools": ["calculator"],
        "tools_kwargs": {"calculator": {"create_kwargs": {"precision": 2}}},
        "reward_model": {"ground_truth": 7, "kind": "tool"},
    }
    bare = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "5"}}  # gsm8k: a number
    path = _write(tmp_path / "mix.jsonl", [verl, alias, bare])
    first, second, third = load_tasks("jsonl", path=str(path))
    assert first.task_id == "jsonl-mix-17" and first.tools == ["calculator", "check_answer"]
    assert first.reward == {"style": "rule", "ground_truth": "4"}  # no kind: the job's reward function scores it
    assert first.meta["data_source"] == "openai/gsm8k" and first.meta["line"] == 1
    assert (
        second.task_id == "mine" and second.messages == alias["messages"] and second.tools == ["calculator"]
    )
    assert second.tools_kwargs == alias["tools_kwargs"] and second.reward == {
        "kind": "tool",
        "ground_truth": 7,
    }
    assert third.task_id == "jsonl-mix-3" and third.tools == [] and third.tools_kwargs == {}
    assert Task.model_validate_json(first.model_dump_json()) == first
    assert load_tasks("jsonl", path=str(tmp_path), split="mix", offset=1) == [second, third]


def test_jsonl_reports_bad_rows_with_file_line_and_field(tmp_path: Path) -> None:
    ok = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}
    bad_rows = {
        "reward_model": ({"prompt": ok["prompt"]}, "missing field 'reward_model'"),
        "ground_truth": (
            {**ok, "reward_model": {"style": "rule"}},
            "missing field 'reward_model.ground_truth'",
        ),
        "prompt type": ({**ok, "prompt": "hi"}, "field 'prompt' must be list"),
        "empty prompt": ({**ok, "prompt": []}, "field 'prompt' is empty"),
        "content": ({**ok, "prompt": [{"role": "user"}]}, "missing field 'prompt[0].content'"),
        "prompt null": ({**ok, "prompt": None}, "field 'prompt' must be list"),
        "bad role": ({**ok, "prompt": [{"role": "bot", "content": "x"}]}, "field 'prompt[0].role' is 'bot'"),
        "tools": ({**ok, "tools": ["calculator", 3]}, "field 'tools[1]' must be str"),
        "kwargs": (
            {**ok, "extra_info": {"tools_kwargs": {"calculator": []}}},
            "'extra_info.tools_kwargs.calculator'",
        ),
        "id": ({**ok, "id": True}, "field 'id' must be a non-empty string or an integer"),
        "long id": ({**ok, "id": "x" * 513}, "field 'id' is 513 characters long; at most 512"),
        "surrogate": ({**ok, "prompt": [{"role": "user", "content": "4\ud83d"}]},
                      "field 'prompt[0].content' holds a lone UTF-16 surrogate"),
        "surrogate key": ({**ok, "extra_info": {"note\udc00": 1}}, "field 'extra_info' holds a lone UTF-16 surrogate"),
    }
    for i, (row, message) in enumerate(bad_rows.values()):
        path = _write(tmp_path / f"bad{i}.jsonl", [ok | {"id": "a"}, row])
        with pytest.raises(ValueError, match=re.escape(f"{path}:2: ") + ".*" + re.escape(message)):
            load_tasks("jsonl", path=str(path))
    dup = _write(tmp_path / "dup.jsonl", [ok | {"id": "a"}, ok, ok | {"id": "a"}])
    with pytest.raises(ValueError, match=re.escape(f"{dup}:3: duplicate task id 'a' (first on line 1)")):
        load_tasks("jsonl", path=str(dup))
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_tasks("jsonl", path=str(tmp_path / "absent.jsonl"))
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_tasks("jsonl", path=str(_write(tmp_path / "ok.jsonl", [ok])), limit=-1)


# Task files that are not UTF-8 (core.text_files): the error names file, line and column, for each file source

@pytest.mark.parametrize(
    ("source", "good", "bad"),
    [
        ("jsonl", {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}},
         b'{"prompt": [{"role": "user", "content": "caf\xe9"}], "reward_model": {"ground_truth": "1"}}'),
        ("gsm8k", {"question": "q", "answer": "#### 1"}, b'{"question": "caf\xe9", "answer": "#### 1"}'),
    ],
)
def test_a_task_file_that_is_not_utf8_names_file_line_and_column(
    tmp_path: Path, source: str, good: dict[str, object], bad: bytes
) -> None:
    path = tmp_path / "latin1.jsonl"
    column = bad.index(b"\xe9") + 1
    path.write_bytes(json.dumps(good).encode() + b"\n" + bad + b"\n")
    with pytest.raises(ValueError) as err:
        load_tasks(source, path=str(path))
    assert str(err.value) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column {column})"
    path.write_bytes(json.dumps(good).encode() + b"\r\n" + json.dumps(good, ensure_ascii=False).encode() + b"\r\n")
    assert len(load_tasks(source, path=str(path))) == 2  # CRLF lines still read


# Reward specs, inline tasks and empty windows are checked when they are given (core.tasks.check), not in a rollout

_ROW = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}


@pytest.mark.parametrize(
    ("reward_model", "message"),
    [
        ({"ground_truth": [1, 2]}, "field 'reward_model.ground_truth' is [1, 2]: the gsm8k reward needs a finite"),
        ({"ground_truth": None}, "field 'reward_model.ground_truth' is None"),
        ({"ground_truth": "abc"}, "field 'reward_model.ground_truth' is 'abc'"),
        ({"ground_truth": float("nan")}, "field 'reward_model.ground_truth' is nan"),
        ({"ground_truth": "Infinity"}, "field 'reward_model.ground_truth' is 'Infinity'"),
        ({"ground_truth": True}, "field 'reward_model.ground_truth' is True"),
        ({"ground_truth": "1", "mode": "fuzzy"}, "field 'reward_model.mode' is 'fuzzy'; valid: strict, flexible"),
        ({"ground_truth": "1", "kind": "gsm8k", "mode": None}, "field 'reward_model.mode' is None"),
        ({"ground_truth": "1", "kind": "os:system"}, "field 'reward_model.kind' is 'os:system': not a built-in"),
    ],
)
def test_jsonl_reward_specs_are_checked_with_the_reward_functions_rules(
    tmp_path: Path, reward_model: dict[str, object], message: str
) -> None:
    path = _write(tmp_path / "gt.jsonl", [_ROW | {"id": "a"}, _ROW | {"reward_model": reward_model}])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: {message}")):
        load_tasks("jsonl", path=str(path), reward="gsm8k")  # the run's default: a row without a kind is its


def test_jsonl_reward_kinds_are_checked_against_the_jobs_reward(tmp_path: Path) -> None:
    good = {"ground_truth": "#### 1,600", "mode": "strict"}
    rows = [_ROW | {"id": "a", "reward_model": good}, _ROW | {"id": "b", "reward_model": {"ground_truth": 3.5}},
            _ROW | {"id": "c", "reward_model": {"ground_truth": [1, 2], "kind": "tool"}}]  # tool reads no ground truth
    assert len(load_tasks("jsonl", path=str(_write(tmp_path / "ok.jsonl", rows)))) == 3
    judge_row = _ROW | {"reward_model": {"ground_truth": {"any": 1}, "kind": "judge"}}
    judged = _write(tmp_path / "judged.jsonl", [judge_row])
    # a row meant for the job's allowlisted function is not the built-ins' business, nor one whose run is not known
    assert load_tasks("jsonl", path=str(judged), reward="judge")[0].reward["kind"] == "judge"
    assert len(load_tasks("jsonl", path=str(judged))) == 1
    for reward in ("gsm8k", "other"):
        with pytest.raises(ValueError, match=re.escape(f"{judged}:1: field 'reward_model.kind' is 'judge': not a "
                                                       f"built-in reward (gsm8k, tool, tool_last) nor this job's "
                                                       f"reward {reward!r}")):
            load_tasks("jsonl", path=str(judged), reward=reward)
    # a built-in kind is checked whatever the job's reward
    bad = _write(tmp_path / "bad.jsonl", [_ROW | {"reward_model": {"ground_truth": "x", "kind": "gsm8k"}}])
    with pytest.raises(ValueError, match=re.escape(f"{bad}:1: field 'reward_model.ground_truth' is 'x'")):
        load_tasks("jsonl", path=str(bad), reward="judge")


def test_a_jsonl_row_without_a_kind_is_scored_by_the_jobs_reward_function(tmp_path: Path) -> None:
    """verl's rows name no reward kind: the job's reward function scores them (its ``reward``, else the run's
    ``rollout.reward``), and the row is checked against that function's rules, not gsm8k's."""
    path = _write(tmp_path / "verl.jsonl", [_ROW | {"reward_model": {"ground_truth": "1"}}])
    [task] = load_tasks("jsonl", path=str(path), reward="tool")
    assert "kind" not in task.reward
    score = RewardComputer("tool").score(task, [], "The answer is 1.", tool_rewards=[0.0])
    assert asyncio.run(score)[0] == 0.0  # the tool reward's, where gsm8k would give the right answer 1.0
    code = _write(tmp_path / "code.jsonl", [_ROW | {"reward_model": {"ground_truth": "def f(): return 1"}}])
    assert len(load_tasks("jsonl", path=str(code), reward="tool")) == 1
    with pytest.raises(ValueError, match="the gsm8k reward needs a finite number"):
        load_tasks("jsonl", path=str(code), reward="gsm8k")


def test_an_empty_file_or_an_offset_past_its_end_names_the_file(tmp_path: Path) -> None:
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=re.escape(f"{empty}: no rows")):
        load_tasks("jsonl", path=str(empty))
    three = _write(tmp_path / "tasks.jsonl", [_ROW | {"id": i} for i in range(3)])
    with pytest.raises(ValueError, match=re.escape(f"offset 5 is past the 3 rows of {three}")):
        load_tasks("jsonl", path=str(three), offset=5)
    with pytest.raises(ValueError, match=re.escape(f"offset 3 is past the 3 rows of {three}")):
        load_tasks("jsonl", path=str(three), offset=3)
    assert [t.task_id for t in load_tasks("jsonl", path=str(three), offset=2)] == ["2"]
    gsm = _write(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(ValueError, match=re.escape(f"offset 1 is past the 1 row of {gsm}")):
        load_tasks("gsm8k", path=str(gsm), offset=1)
    with pytest.raises(ValueError, match=re.escape(f"{_write(tmp_path / 'none.jsonl', [])}: no rows")):
        load_tasks("gsm8k", path=str(tmp_path / "none.jsonl"))


def test_a_file_is_read_no_further_than_offset_plus_limit(tmp_path: Path) -> None:
    """A job's limit bounds what a large file costs: the rows past offset + limit are never read (a bad row there
    fails no job that stops before it), while every row read, those before the offset too, is checked."""
    rows = _write(tmp_path / "rows.jsonl", [_ROW | {"id": i} for i in range(4)] + ["{not json"])
    assert [t.task_id for t in load_tasks("jsonl", path=str(rows), offset=1, limit=2)] == ["1", "2"]
    assert [t.task_id for t in load_tasks("jsonl", path=str(rows), offset=3, limit=1)] == ["3"]
    with pytest.raises(ValueError, match=re.escape(f"{rows}:5: invalid JSON")):
        load_tasks("jsonl", path=str(rows), offset=3, limit=2)
    with pytest.raises(ValueError, match=re.escape(f"offset 6 is past the 3 rows of {rows.with_name('three.jsonl')}")):
        load_tasks("jsonl", path=str(_write(rows.with_name("three.jsonl"), [_ROW | {"id": i} for i in range(3)])),
                   offset=6, limit=2)
    skipped_bad = _write(tmp_path / "skipped.jsonl", [{"prompt": _ROW["prompt"]}, _ROW])
    with pytest.raises(ValueError, match=re.escape(f"{skipped_bad}:1: missing field 'reward_model'")):
        load_tasks("jsonl", path=str(skipped_bad), offset=1, limit=1)
    good = {"question": "How many?", "answer": "#### 7"}
    gsm = _write(tmp_path / "gsm.jsonl", [good, "", good, json.dumps({"question": "q", "answer": "no marker"})])
    assert [t.task_id for t in load_tasks("gsm8k", path=str(gsm), limit=2)] == ["gsm8k-gsm-1", "gsm8k-gsm-3"]
    with pytest.raises(ValueError, match=re.escape(f"{gsm}:4: field 'answer' does not end with '#### <number>'")):
        load_tasks("gsm8k", path=str(gsm), offset=1)


def _inline(*tasks: dict[str, object], **job: object):
    from core.jobs import JobSpec

    return JobSpec.model_validate({"source": {"kind": "inline", "tasks": list(tasks)}, **job})


def test_inline_tasks_get_the_jsonl_row_checks_naming_their_path() -> None:
    ok = {"task_id": "a", "messages": [{"role": "user", "content": "q"}], "reward": {}}
    bad = {
        "source.tasks[1].messages[0].role' is 'bot'; valid: system, user, assistant, tool":
            {"messages": [{"role": "bot", "content": 5}]},
        "missing field 'source.tasks[1].messages[0].role'": {"messages": [{"content": "q"}]},
        "field 'source.tasks[1].messages[1].content' must be str, got NoneType":
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
        "field 'source.tasks[1].reward.ground_truth' is [1, 2]": {"reward": {"kind": "gsm8k", "ground_truth": [1, 2]}},
        "field 'source.tasks[1].reward.mode' is 'fuzzy'": {"reward": {"kind": "gsm8k", "ground_truth": 1,
                                                                      "mode": "fuzzy"}},
        "field 'source.tasks[1].reward.kind' must be str, got int": {"reward": {"kind": 5}},
        "field 'source.tasks[1].reward.kind' is 'os:system'": {"reward": {"kind": "os:system"}},
        "field 'source.tasks[1].task_id': duplicate task id 'a' (first at source.tasks[0])": {"task_id": "a"},
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            _inline(ok, ok | {"task_id": "b"} | change).load_tasks()
    # no kind: scored by the job's reward function, checked when that is a built-in the job names
    assert len(_inline(ok).load_tasks()) == 1 and len(_inline(ok, reward="tool").load_tasks()) == 1
    assert len(_inline(ok, reward="judge").load_tasks()) == 1  # an allowlisted function: its rules are not core's
    with pytest.raises(ValueError, match=re.escape("missing field 'source.tasks[0].reward.ground_truth'")):
        _inline(ok, reward="gsm8k").load_tasks()
    assert len(_inline(ok, reward="gsm8k", agent="pkg.mod:agent").load_tasks()) == 1  # the agent may post the reward
    with pytest.raises(ValueError, match=re.escape("field 'source.tasks[0].reward.kind' is 'foo'")):
        _inline(ok | {"reward": {"kind": "foo"}}, reward="judge").load_tasks()
    judged = _inline(ok | {"reward": {"kind": "judge", "rubric": [1]}}, reward="judge").load_tasks()
    assert judged[0].reward["kind"] == "judge"
    # the caller may name the function that scores the job when the job does not (the run's rollout.reward)
    with pytest.raises(ValueError, match="reward.ground_truth"):
        _inline(ok).load_tasks(run_reward="gsm8k")


def test_arith_past_its_stream_is_refused_at_once() -> None:
    """The stream is made from its start: an offset in the hundred millions (a job's, ``rollout --index``'s) would
    hold the API's request thread for hours and fill its memory; it is refused naming the position."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"arith: offset \+ limit = 100000005 is past the first 200000 tasks"):
        load_tasks("arith", split="test", limit=5, offset=10**8)
    assert time.monotonic() - started < 1
