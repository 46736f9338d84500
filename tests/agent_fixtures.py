"""Agents for the agent-job tests: run by ``rollout_server.agent_runner`` in their own processes.

``AGENT_FIXTURE_DIR`` (inherited from the test through the worker) is where ``first_fails`` claims its
one failure, so exactly one sample of a group crashes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any


def crash(task: dict[str, Any], base_url: str, api_key: str) -> float:
    raise RuntimeError("the agent crashed")


def sleep(task: dict[str, Any], base_url: str, api_key: str) -> float:
    time.sleep(600)
    return 1.0


def hog(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Allocates 1 GiB: under a smaller rollout.agent_memory_mb this is a MemoryError."""
    return float(len(bytearray(1 << 30)))


def environment(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Fails, naming which of the rollout server's secrets (and Redis's address) its environment holds."""
    names = ("ROLLWAVE_CHECKPOINT_TOKEN", "ROLLWAVE_API_TOKEN", "ROLLWAVE_ENGINE_API_KEY", "ROLLWAVE_REDIS_PASSWORD",
             "REDIS_URL")
    raise RuntimeError(f"visible: {[name for name in names if name in os.environ]}")


def warmed(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Fails, saying whether its process started with the openai client's first-call modules loaded (forked
    from the warmed-up fork server, ``rollout_server.agent_warmup``)."""
    raise RuntimeError(f"warmed: {'openai.resources.chat.completions' in sys.modules}")


def first_fails(task: dict[str, Any], base_url: str, api_key: str) -> float:
    try:
        os.close(os.open(Path(os.environ["AGENT_FIXTURE_DIR"]) / task["task_id"], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        import openai  # here, so the other fixtures start fast

        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
        client.chat.completions.create(model="policy", messages=task["messages"], max_tokens=4)
        return 0.25
    raise RuntimeError("the first sample of each task fails")


def cpus(task: dict[str, Any], base_url: str, api_key: str) -> float:
    """Fails, naming the CPUs its process may run on (``placement.agent_cpus``)."""
    raise RuntimeError(f"cpus: {sorted(os.sched_getaffinity(0))}")
