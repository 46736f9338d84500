"""The job spec refuses what a job could not honour (a temperature the engines sample greedily, a source field its
kind would ignore) rather than run it otherwise than asked."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from core.jobs import JobSpec
from services.cli import build_parser
from services.client_cmd import job_from_args

ARITH = {"kind": "arith", "limit": 2}
TASKS = [{"task_id": t, "messages": [{"role": "user", "content": t}], "reward": {}} for t in ("a", "b", "c")]


def test_a_train_temperature_the_engines_sample_greedily_is_refused() -> None:
    """Below 1e-6 both engines sample greedily, while the trainer divides the logits by the temperature; an eval job
    (never trained on) may sample greedily."""
    for temperature in (0, 5e-7):
        with pytest.raises(ValidationError, match=r"sampling.temperature: .* cannot be trained on: below 1e-06 the "
                           r"engines sample greedily .* use >= 1e-06"):
            JobSpec.model_validate({"source": ARITH, "sampling": {"temperature": temperature}})
        evaluation = JobSpec.model_validate({"kind": "eval", "source": ARITH, "sampling": {"temperature": temperature}})
        assert evaluation.sampling.temperature == temperature
    assert JobSpec.model_validate({"source": ARITH, "sampling": {"temperature": 1e-6}}).sampling.temperature == 1e-6


@pytest.mark.parametrize(("source", "field", "readers"), [
    ({"kind": "arith", "limit": 2, "path": "x.jsonl"}, "path", "gsm8k, jsonl"),
    ({"kind": "gsm8k", "seed": 3}, "seed", "arith"),
    ({"kind": "jsonl", "path": "x.jsonl", "seed": 3}, "seed", "arith"),
    ({"kind": "inline", "tasks": TASKS, "path": "x.jsonl"}, "path", "gsm8k, jsonl"),
    ({"kind": "inline", "tasks": TASKS, "split": "test"}, "split", "arith, gsm8k, jsonl"),
    ({"kind": "inline", "tasks": TASKS, "seed": 3}, "seed", "arith"),
])
def test_a_source_field_its_kind_would_ignore_is_refused(source: dict[str, Any], field: str, readers: str) -> None:
    with pytest.raises(ValidationError, match=rf"source.{field}: kind={source['kind']} does not read it, so it would "
                       rf"be ignored \(kind {readers} reads it\)"):
        JobSpec.model_validate({"source": source})


def test_inline_tasks_honour_offset_and_limit() -> None:
    """Every inline task is checked; offset and limit pick the ones the job holds, as they pick a file's rows."""
    spec = JobSpec.model_validate({"source": {"kind": "inline", "tasks": TASKS, "offset": 1, "limit": 1}})
    assert [t.task_id for t in spec.load_tasks()] == ["b"]
    spec = JobSpec.model_validate({"source": {"kind": "inline", "tasks": TASKS, "offset": 1}})
    assert [t.task_id for t in spec.load_tasks()] == ["b", "c"]
    with pytest.raises(ValidationError, match=r"source.offset: 3 is past the 3 inline tasks"):
        JobSpec.model_validate({"source": {"kind": "inline", "tasks": TASKS, "offset": 3}})
    dup = JobSpec.model_validate({"source": {"kind": "inline", "tasks": [*TASKS, TASKS[0]], "limit": 1}})
    with pytest.raises(ValueError, match="duplicate task id 'a'"):  # a task the window leaves out is still checked
        dup.load_tasks()


@pytest.mark.parametrize("source", [
    {"kind": "arith", "limit": 2, "seed": 3, "split": "test", "offset": 1},
    {"kind": "gsm8k", "split": "test", "limit": 2},
    {"kind": "jsonl", "path": "x.jsonl", "offset": 1},
    {"kind": "inline", "tasks": TASKS, "limit": 2},
])
def test_a_stored_spec_validates_again(source: dict[str, Any]) -> None:
    """A rollout worker validates the spec the API stored (every field dumped, seed 0 included) again."""
    spec = JobSpec.model_validate({"source": source})
    assert JobSpec.model_validate_json(spec.model_dump_json()) == spec


def test_the_clis_jobs_are_refused_only_for_fields_it_was_given() -> None:
    """``rollwave submit`` sets only the source fields given as flags (its defaults are None)."""
    def body(*argv: str) -> dict[str, Any]:
        return job_from_args(build_parser().parse_args(["submit", *argv]))

    for argv in (["--source", "gsm8k", "--limit", "5"], ["--source", "jsonl", "--path", "x.jsonl", "--split", "test"],
                 ["--source", "arith", "--limit", "5", "--seed", "3", "--split", "test"]):
        assert JobSpec.model_validate(body(*argv)).source.kind == argv[1]
    with pytest.raises(ValidationError, match=r"source.seed: kind=gsm8k does not read it"):
        JobSpec.model_validate(body("--source", "gsm8k", "--seed", "1"))
