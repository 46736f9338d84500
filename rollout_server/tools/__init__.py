"""Tools the agent loop can call: the ``Tool`` protocol, the built-ins and the YAML tool registry."""

from rollout_server.tools.base import Tool, ToolResult
from rollout_server.tools.registry import ToolConfigError, ToolRegistry

__all__ = ["Tool", "ToolConfigError", "ToolRegistry", "ToolResult"]
