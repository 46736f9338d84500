"""A rollout server's config or the operator's code it names, wrong: refused when the server starts (the start check,
whose ConfigError is one line and exit 2, which launchers do not restart), naming the key, the file and line, and what
to do; never a traceback, nor every task of a job failing later. In-process, as ``python -m rollout_server`` checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.config import ConfigError, RolloutConfig, load_config
from rollout_server.__main__ import _start, check_code
from rollout_server.sglang_launcher import build_command
from rollout_server.tools import ToolConfigError, ToolRegistry
from services.cli import main as cli

TOKEN = "t" * 40
NOT_HERE = "192.0.2.1"  # TEST-NET-1: an address of no host here

TOOLS = '''
from rollout_server.tools.base import Tool, ToolResult


class NeedsSandbox(Tool):
    def __init__(self, name=None, schema=None):
        raise RuntimeError("no sandbox on this host")

    async def execute(self, instance_id, arguments):
        return ToolResult("")
'''
AGENTS = '''
import os


async def run(task, base_url, api_key):
    return 1.0


async def two(task, base_url):
    return 1.0


async def stream(task, base_url, api_key):
    yield 1.0


NOT_A_FUNCTION = 42
if "ROLLWAVE_CHECKPOINT_TOKEN" in os.environ:  # imported only where the agents run, without the server's secrets
    raise RuntimeError("an agent's module sees the server's checkpoint token")
'''


@pytest.fixture
def code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Modules of the operator's code on the path: a tool, a reward function, agents, one that raises at import, one
    not Python."""
    (tmp_path / "startup_tools.py").write_text(TOOLS)
    (tmp_path / "startup_rewards.py").write_text("async def judge(task, final_text):\n    return 1.0\n")
    (tmp_path / "startup_agents.py").write_text(AGENTS)
    (tmp_path / "startup_boom.py").write_text("\n\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "startup_typo.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ROLLWAVE_CHECKPOINT_TOKEN", TOKEN)
    return tmp_path


@pytest.mark.parametrize(("body", "message"), [
    ("- name: x\n  class: startup_boom:Tool\n",
     ":1: tools[0] (x): cannot import class 'startup_boom:Tool': importing startup_boom raised RuntimeError: no GPU "
     "here ({tmp}/startup_boom.py:3)"),
    ("- name: calculator\n- name: x\n  class: startup_typo:Tool\n",
     ":2: tools[1] (x): cannot import class 'startup_typo:Tool': importing startup_typo raised SyntaxError: invalid "
     "syntax ({tmp}/startup_typo.py:1)"),
    ("- name: x\n  class: startup_tools:NeedsSandbox\n",
     ":1: tools[0] (x): cannot construct startup_tools:NeedsSandbox: RuntimeError: no sandbox on this host"),
    ("tools:\n  - name: calculator\n  - name: python\n  - name: calculator\n",
     ":4: tools[2]: two tools are named 'calculator' (the other is tools[0], line 2); each tool needs a name of its "
     "own"),
], ids=["raises at import", "not python", "constructor raises", "a name twice"])
def test_a_tool_config_that_cannot_be_built_names_the_file_line_and_entry(code: Path, body: str, message: str) -> None:
    """Whatever the operator's tool module or constructor raises is a ToolConfigError naming the entry (and where the
    module raised), not a traceback; a name given twice names both entries' lines."""
    cfg = code / "tools.yaml"
    cfg.write_text(body)
    with pytest.raises(ToolConfigError) as info:
        ToolRegistry.from_file(cfg)
    assert str(info.value) == f"{cfg}{message.format(tmp=code)}"


def test_code_the_allowlists_name_that_cannot_run_is_refused_naming_each_entry(code: Path) -> None:
    """A reward function or an agent that cannot be called as it will be (its module raises at import, it takes
    other arguments, it is no function, it is a generator) is refused at start, not at every episode of a job. The
    agents are checked in a process of their own, without the server's secrets (this one has a checkpoint token)."""
    with pytest.raises(ConfigError, match=re.escape(
            "rollout.reward_allowlist.judge: reward 'judge' (startup_boom:judge): cannot import: importing "
            f"startup_boom raised RuntimeError: no GPU here ({code}/startup_boom.py:3)")):
        check_code(RolloutConfig(reward_allowlist={"judge": "startup_boom:judge"}))
    with pytest.raises(ConfigError, match=re.escape(
            "rollout.reward_allowlist.judge: reward 'judge' (startup_rewards:judge): takes (task, final_text) (too "
            "many positional arguments); a reward function is called as fn(task, messages, final_text, tool_rewards)")):
        check_code(RolloutConfig(reward_allowlist={"judge": "startup_rewards:judge"}))
    entries = ["startup_agents:run", "startup_boom:run", "startup_agents:two", "startup_agents:NOT_A_FUNCTION",
               "startup_agents:stream", "startup_agents:missing", "startup_typo:run"]
    with pytest.raises(ConfigError) as info:
        check_code(RolloutConfig(agent_allowlist=entries))
    assert str(info.value) == "; ".join([
        f"rollout.agent_allowlist: startup_boom:run: importing startup_boom raised RuntimeError: no GPU here "
        f"({code}/startup_boom.py:3)",
        "startup_agents:two: takes (task, base_url) (too many positional arguments); an agent is called as "
        "fn(task, base_url, api_key)",
        "startup_agents:NOT_A_FUNCTION: 42 is not callable; an agent is a function",
        "startup_agents:stream: is a generator function; an agent returns its reward (a float or None)",
        "startup_agents:missing: module 'startup_agents' has no attribute 'missing'",
        f"startup_typo:run: importing startup_typo raised SyntaxError: invalid syntax ({code}/startup_typo.py:1)",
    ])
    check_code(RolloutConfig(agent_allowlist=["startup_agents:run"]))
    (code / "startup_slow.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(ConfigError, match=r"^rollout\.agent_allowlist: importing the agents' modules took over 0\.5s "
                                          r"\(rollout\.agent_timeout_s\)$"):
        check_code(RolloutConfig(agent_allowlist=["startup_slow:run"], agent_timeout_s=0.5))


def test_the_start_check_builds_the_tools_and_refuses_addresses_not_of_this_host(code: Path) -> None:
    """The tools are built by the start check, so a bad tool config is a config the launcher hears refused (it was
    built after the server had told its launcher the config was good); an address to listen on that is not this
    host's is a ConfigError naming the key (it was a traceback once bound, and a restart, to fail again); so is an
    SGLang backend without the URLs of its servers."""
    env = {"ROLLWAVE_CHECKPOINT_TOKEN": TOKEN}
    assert sorted(_start(load_config(None, [], env=env)).tools) == ["calculator", "check_answer", "python"]
    with pytest.raises(ConfigError, match=rf"^rollout\.tools: tool config {code}: Is a directory$"):
        _start(load_config(None, [f"rollout.tools={code}"], env=env))
    for key in ("rollout.openai_host", "rollout.grpc_host", "engine.host"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: cannot listen on '{NOT_HERE}': "):
            _start(load_config(None, [f"{key}={NOT_HERE}"], env=env))
    _start(load_config(None, [f"engine.host={NOT_HERE}", "engine.urls=[http://127.0.0.1:30000]"], env=env))
    with pytest.raises(ConfigError, match=r"^engine\.urls: engine\.backend=sglang needs the URLs of running servers"):
        _start(load_config(None, ["engine.backend=sglang"], env=env))  # was refused once Redis was up


@pytest.mark.parametrize(("overrides", "message"), [
    (["engine.urls=[http://127.0.0.1:30000/v1]"],
     "engine.urls: http://127.0.0.1:30000/v1 is not an engine URL: want http(s)://host:port, e.g. "
     "http://127.0.0.1:30000 (no path: the engine's routes are at its root)"),
    (["engine.urls=[http://127.0.0.1:30000, http://LOCALHOST:30001, http://127.0.0.1:30000/]"],
     "engine.urls: 'http://127.0.0.1:30000' and 'http://127.0.0.1:30000/' are one engine: list each engine once"),
], ids=["a path", "one engine twice"])
def test_engine_urls_with_a_path_or_one_engine_twice_are_refused(overrides: list[str], message: str) -> None:
    """A path was polled for an hour (``engine.ready_timeout_s``) at ``<path>/health``; one engine twice took two
    shares of the requests and every weight push twice."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_a_config_file_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^config file {re.escape(str(tmp_path))}: Is a directory$"):
        load_config(tmp_path)


def test_sglang_arguments_that_would_override_the_launchers_are_refused_before_it_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An SGLang flag after ``--`` that the launcher sets overrode it (SGLang takes the last): a --host bound SGLang
    off loopback without the key --host requires, an --api-key put the key in the command line. Abbreviations too;
    the value (a key) is never echoed."""
    with pytest.raises(ValueError, match=r"^--api-key \(after --\) would override SGLang's --api-key as this command "
                                         r"sets it; give the key in --api-key-file or ROLLWAVE_ENGINE_API_KEY") as info:
        build_command("m", 1, extra=["--api-key=secret-key-value"])
    assert "secret-key-value" not in str(info.value)
    with pytest.raises(ValueError, match=r"^--hos \(after --\) would override SGLang's --host .*; give --host$"):
        build_command("m", 1, extra=["--log-level", "info", "--hos", "0.0.0.0"])
    with pytest.raises(ValueError, match=r"^--lora-target-modules needs --lora-rank"):
        build_command("m", 1, lora_targets=["q_proj"])
    assert cli(["engine", "sglang", "--model", "m", "--port", "1", "--python", "/nonexistent/python", "--",
                "--host", "0.0.0.0"]) == 2  # before sglang is looked for, let alone started
    assert capsys.readouterr().err.startswith("error: --host (after --) would override SGLang's --host")
