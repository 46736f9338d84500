"""The README's command tables and config snippets, read from README.md and checked against the code: every flag a
row of "The `rollwave` command" or `make demo`'s row names is one the parser takes (and `make demo`'s row names each
of the demo's flags), and the run config and job that "Training an existing OpenAI-client agent" and "LoRA" show
validate, so the README cannot drift from the CLI."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import yaml

from core.config import Config
from core.jobs import JobSpec
from services.cli import build_parser
from services.demo import _parser as demo_parser

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
FLAG = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def _section(title: str) -> str:
    """The README's text under the heading ``title``, up to the next heading of any level."""
    [body] = re.findall(rf"^#+ {re.escape(title)}\n(.*?)(?=^#)", README, re.S | re.M)
    return body


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _rollwave_rows() -> list[str]:
    """The first cell of each row of the `rollwave` command table: ``rollwave submit [-f job.yaml] ...``."""
    rows = re.findall(r"^\| `(rollwave [^`]*)` \|", _section("The `rollwave` command"), re.M)
    assert len(rows) >= 10, rows
    return rows


def test_every_rollwave_command_and_flag_in_the_readme_is_the_parsers() -> None:
    for row in _rollwave_rows():
        words = row.replace("\\|", "|").split()[1:]
        parser: argparse.ArgumentParser = build_parser()
        flags = set()
        for word in words:  # the subcommands come first; the rest are flags, their values and brackets
            sub = _subparser(parser, word) if not flags and re.fullmatch(r"[a-z]+", word) else None
            if sub is not None:
                parser = sub
                continue
            flags |= set(FLAG.findall(word))
        missing = flags - _options(parser) - _options(build_parser())  # --debug is the top parser's too
        assert not missing, f"README row `{row}`: {parser.prog} takes no {', '.join(sorted(missing))}"


def test_make_demos_flags_in_the_readme_are_the_demos() -> None:
    [row] = re.findall(r"^\| `make demo` \|(.*)$", README, re.M)
    [flags_text] = re.findall(r"flags: (.*?)`key=value` overrides", row)
    flags = set(FLAG.findall(re.sub(r"`[^`]*\.\w+`|runs/<name>/sft", "", flags_text)))
    parser = demo_parser()
    assert flags <= _options(parser), f"make demo's row names {sorted(flags - _options(parser))}"
    unnamed = [action.option_strings for action in parser._actions
               if action.option_strings and action.dest != "help" and not flags & set(action.option_strings)]
    assert not unnamed, f"make demo's row leaves out {unnamed}"
    assert set(re.findall(r"(--[a-z-]+)", row.partition("e.g.")[2])) <= _options(demo_parser())


def test_the_readmes_agent_run_config_and_job_validate() -> None:
    [block] = re.findall(r"```yaml\n(# run\.yaml: the operator allows.*?)```", README, re.S)
    run_part, _, job_part = block.partition("# job.yaml")
    cfg = Config.model_validate(yaml.safe_load(run_part))
    job = JobSpec.model_validate(yaml.safe_load(job_part.partition("\n")[2]))
    assert job.agent in cfg.rollout.agent_allowlist


def test_the_readmes_lora_config_validates() -> None:
    [block] = re.findall(r"### LoRA\n\n```yaml\n(.*?)```", README, re.S)
    cfg = Config.model_validate(yaml.safe_load(block))
    assert cfg.model.lora is not None and cfg.model.lora.rank == 16
