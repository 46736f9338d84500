"""The README's OpenAI-client agent ("Training an existing OpenAI-client agent"), taken from the README and run as
written against the episode endpoint, so the example a user copies cannot drift from one that works."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import openai

from rollout_server.agent_runner import agent_task
from rollout_server.openai_api import AgentEpisode, EpisodeStore
from tests.test_agent_loop import CALC, ScriptedEngine
from tests.test_openai_api import TASK, _run

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_agent(tmp_path: Path) -> ModuleType:
    """``my_agents.py`` exactly as the README shows it, imported."""
    [code] = re.findall(r"```python\n(# my_agents\.py.*?)```", README.read_text(), re.S)
    (tmp_path / "my_agents.py").write_text(code)
    spec = importlib.util.spec_from_file_location("my_agents", tmp_path / "my_agents.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_agent_calls_its_tool_and_its_answer_is_scored(tmp_path: Path, tokenizer: Any) -> None:
    agent = readme_agent(tmp_path)
    engine = ScriptedEngine(tokenizer, [("Let me compute. " + CALC.format("6*7"), "stop"),
                                        ("The answer is 42.", "stop")])

    async def drive(client: openai.AsyncOpenAI, ep: AgentEpisode, store: EpisodeStore) -> None:
        assert await agent.solve(agent_task(TASK), store.base_url(ep), ep.key) is None

    sample, _ = _run(tokenizer, engine, drive, max_new_tokens=64)
    assert sample.num_turns == 2 and [(t.name, t.ok) for t in sample.tool_calls] == [("calculator", True)]
    assert [m["content"] for m in sample.messages if m["role"] == "tool"] == ["42"]
    assert sample.reward == 1.0  # the job's reward function scored the final answer (ground truth 42)
