"""The tool protocol (verl's ``BaseTool`` shape): per-episode instances, async execute, a reward.

The agent loop knows tools only through this class: ``create`` an instance for an episode,
``execute`` calls with parsed JSON arguments, ``release`` at the end. Tools that run anything slow
must not block the event loop (use subprocesses or ``asyncio.to_thread``).
"""

from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import Any, ClassVar

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name: what a model is given to call


@dataclass
class ToolResult:
    """What one call returns: the text shown to the model, an optional reward, and the outcome. ``outcome`` names
    a call the tool would not run, or stopped, as ``rollwave_rollout_tool_calls_total`` counts it: ``refused`` (it
    cannot run here: no sandbox), ``busy`` (at its limit of calls at once: it may run later), ``sandbox_timeout`` and
    ``output_limit`` (the python tool stopped the snippet at its ``timeout_s`` or ``max_output_bytes``)."""

    text: str
    reward: float | None = None
    ok: bool = True
    error: str | None = None
    outcome: str | None = None

    @classmethod
    def failure(cls, error: str) -> ToolResult:
        return cls(text=f"Error: {error}", ok=False, error=error)


class Tool(abc.ABC):
    """Base class of every tool. Subclasses set ``default_name``/``default_schema`` and override ``execute``.

    ``schema`` is the OpenAI function schema ``{"type": "function", "function": {name, description,
    parameters}}`` rendered into the prompt; a tool config may replace it. ``kwargs`` of the config
    reach ``__init__``; per-episode data (e.g. a ground truth) reaches ``create``, which refuses an
    episode without the keys of ``create_requires``: the API reads them (without building the tool) to
    refuse a job whose tasks do not give them, rather than have every episode fail at create.
    """

    default_name: ClassVar[str] = ""
    default_schema: ClassVar[dict[str, Any]] = {}
    create_requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str | None = None, schema: dict[str, Any] | None = None) -> None:
        self.name = name or self.default_name
        if not self.name:
            raise ValueError(f"{type(self).__name__}: a tool needs a name")
        self.schema = copy.deepcopy(schema if schema is not None else self.default_schema)
        if isinstance(self.schema.get("function"), dict):  # the name the model calls is the tool's
            self.schema["function"]["name"] = self.name
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Start an episode's instance; ``create_kwargs`` come from the task's ``tools_kwargs`` and must hold the
        keys of ``create_requires`` (ValueError naming those missing)."""
        if missing := [key for key in self.create_requires if key not in create_kwargs]:
            raise ValueError(f"{self.name}: create_kwargs need {', '.join(missing)} (task tools_kwargs)")
        self._instances[instance_id] = dict(create_kwargs)

    @abc.abstractmethod
    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call of the episode ``instance_id``; failures come back as ``ToolResult(ok=False)``."""

    async def release(self, instance_id: str) -> None:
        """End an episode's instance. Called once for every ``create`` that was started, also one that raised or was
        cancelled at ``rollout.tool_timeout_s`` (it may have taken something first), so an unknown id is no error."""
        self._instances.pop(instance_id, None)

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """An error message when required arguments are missing or unknown ones given, else None."""
        params = self.schema.get("function", {}).get("parameters", {})
        missing = [k for k in params.get("required", []) if k not in arguments]
        if missing:
            return f"{self.name}: missing required argument(s) {', '.join(missing)}"
        props = params.get("properties")
        if props is not None and params.get("additionalProperties") is False:
            unknown = sorted(set(arguments) - set(props))
            if unknown:
                return f"{self.name}: unknown argument(s) {', '.join(unknown)}"
        return None


def function_schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    """An OpenAI-style function schema that rejects unknown arguments."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }
