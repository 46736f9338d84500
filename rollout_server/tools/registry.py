"""Load tools from a YAML tool config; without one, the built-in tools.

The file is a list (or ``{tools: [...]}``) of entries::

    - name: calculator                                     # the name the model calls (an OpenAI function name)
      class: rollout_server.tools.calculator:CalculatorTool  # ``module:Class`` or ``module.Class``
      schema: {type: function, function: {...}}             # optional: replaces the default schema
      kwargs: {timeout_s: 5}                                # optional: passed to the constructor

A custom tool is any ``Tool`` subclass named by import path. Errors name the file and the entry.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.imports import import_object
from core.text_files import TextFileError, line_of, load_yaml, yaml_key_lines
from rollout_server.tools.base import FUNCTION_NAME, Tool

log = logging.getLogger(__name__)

BUILTIN_TOOLS: dict[str, str] = {
    "calculator": "rollout_server.tools.calculator:CalculatorTool",
    "python": "rollout_server.tools.python_tool:PythonTool",
    "check_answer": "rollout_server.tools.check_answer:CheckAnswerTool",
}
_ENTRY_KEYS = {"name", "class", "schema", "kwargs"}
T = TypeVar("T")


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded; the message names the file and the entry."""


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Parameters(_Open):
    """JSON Schema of the arguments, as far as the tools' own argument check reads it."""

    type: Literal["object"]
    properties: dict[str, dict[str, Any]] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class _Function(_Open):
    name: str | None = None
    description: str = ""
    parameters: _Parameters = Field(default_factory=lambda: _Parameters(type="object"))


class _ToolSchema(_Open):
    """An OpenAI function schema: ``{type: function, function: {name, description, parameters}}``."""

    type: Literal["function"]
    function: _Function


class ToolRegistry:
    """The tools a rollout server offers, by name; a task picks a subset through ``task.tools``."""

    def __init__(self, tools: list[Tool]) -> None:
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ToolConfigError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool

    @classmethod
    def builtin(cls) -> ToolRegistry:
        return cls([_build({"name": name}, "built-in tools") for name in BUILTIN_TOOLS])

    @classmethod
    def from_file(cls, path: str | Path | None) -> ToolRegistry:
        """Tools of a YAML config, or the built-in ones when ``path`` is None."""
        if path is None:
            return cls.builtin()
        return cls(_each_entry(Path(path), _build))

    def get(self, name: str) -> Tool:
        if name not in self.tools:
            raise KeyError(f"unknown tool {name!r}; configured: {', '.join(sorted(self.tools)) or 'none'}")
        return self.tools[name]

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        """OpenAI function schemas of ``names``, in that order (what the chat template renders)."""
        return [self.get(n).schema for n in names]


def tool_requirements(path: str | Path | None) -> dict[str, tuple[str, ...] | None]:
    """The tools a YAML config (None: the built-in tools) configures, by name, each with the create kwargs it requires
    (``Tool.create_requires``): the classes are imported as the registry does, but no tool is built, so the API can
    check what a job asks of the tools where they do not run. A class that cannot be imported here (the API's host
    may lack a tool's dependencies) maps to None: its name is still known. ToolConfigError for a file that is not
    a tool config (as ``ToolRegistry.from_file``)."""

    def requirements(entry: Any, where: str) -> tuple[str, tuple[str, ...] | None]:
        name, class_path, where = _locate(entry, where)
        try:
            return name, _import_tool(class_path, where).create_requires
        except ToolConfigError as exc:  # the operator's module, importing anything: the rollout servers will say
            log.warning("%s; it cannot be imported here: jobs are checked for its name only", exc)
            return name, None

    if path is None:
        return dict(requirements({"name": name}, "built-in tools") for name in BUILTIN_TOOLS)
    return dict(_each_entry(Path(path), requirements))


def _each_entry(path: Path, make: Callable[[Any, str], T]) -> list[T]:
    """``make(entry, "tools[i]")`` for each entry of the file; a ToolConfigError (a name given twice too) is prefixed
    by the file and line."""
    entries, under = _entries(path)
    made: list[T] = []
    first: dict[str, int] = {}
    for i, entry in enumerate(entries):
        try:
            made.append(make(entry, f"tools[{i}]"))
            if (j := first.setdefault(entry["name"], i)) != i:  # ``make`` checked the name
                line = line_of(yaml_key_lines(path), (*under, j))
                raise ToolConfigError(f"tools[{i}]: two tools are named {entry['name']!r} (the other is tools[{j}], "
                                      f"line {line}); each tool needs a name of its own")
        except ToolConfigError as exc:  # the file's lines are looked up only for an error
            raise ToolConfigError(f"{path}:{line_of(yaml_key_lines(path), (*under, i))}: {exc}") from None
    return made


def _entries(path: Path) -> tuple[list[Any], tuple[str, ...]]:
    """The tool entries of the file, and the keys they are under in it (``("tools",)`` or none)."""
    try:
        data = load_yaml(path)
    except FileNotFoundError:
        raise ToolConfigError(f"tool config {path} does not exist") from None
    except OSError as exc:  # a directory, a file it may not read
        raise ToolConfigError(f"tool config {path}: {exc.strerror or exc}") from None
    except TextFileError as exc:  # not UTF-8, not YAML, a key twice: names the file and the line
        raise ToolConfigError(str(exc)) from None
    entries = data.get("tools") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise ToolConfigError(f"{path}: expected a list of tools (or a mapping with key 'tools')")
    return entries, ("tools",) if isinstance(data, dict) else ()


def _locate(entry: Any, where: str) -> tuple[str, str, str]:
    """The entry's name and class path, checked, and ``where`` with the name."""
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        valid = ", ".join(sorted(_ENTRY_KEYS))
        raise ToolConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {valid}")
    name = entry.get("name")
    if not isinstance(name, str) or not re.fullmatch(FUNCTION_NAME, name):
        raise ToolConfigError(f"{where}: 'name' must be an OpenAI function name, 1-64 letters, digits, _ or -, "
                              f"got {name!r}")
    where = f"{where} ({name})"
    class_path = entry.get("class", BUILTIN_TOOLS.get(name))
    if not isinstance(class_path, str):
        raise ToolConfigError(
            f"{where}: 'class' (an import path) is required for a tool that is not built in"
        )
    return name, class_path, where


def _import_tool(class_path: str, where: str) -> type[Tool]:
    try:
        tool_cls = import_object(class_path)
    except ImportError as exc:
        raise ToolConfigError(f"{where}: cannot import class {class_path!r}: {exc}") from None
    if not (isinstance(tool_cls, type) and issubclass(tool_cls, Tool)):
        raise ToolConfigError(f"{where}: {class_path} is not a subclass of rollout_server.tools.base.Tool")
    requires = tool_cls.create_requires
    if not (isinstance(requires, tuple) and all(isinstance(key, str) for key in requires)):  # ("x") is a str
        raise ToolConfigError(f"{where}: {class_path}.create_requires must be a tuple of str, got {requires!r}")
    return tool_cls


def _build(entry: Any, where: str) -> Tool:
    name, class_path, where = _locate(entry, where)
    tool_cls = _import_tool(class_path, where)
    schema = entry.get("schema")
    if schema is not None:
        try:
            _ToolSchema.model_validate(schema)
        except ValidationError as exc:
            err = exc.errors()[0]
            at = ".".join(["schema", *map(str, err["loc"])])
            raise ToolConfigError(f"{where}: {at}: {err['msg']} (an OpenAI function schema: {{type: function, "
                                  "function: {name, description, parameters: {type: object, properties, "
                                  "required}}}})") from None
    kwargs = entry.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ToolConfigError(f"{where}: 'kwargs' must be a mapping")
    try:
        return tool_cls(name=name, schema=schema, **kwargs)
    except Exception as exc:  # the operator's constructor, doing anything (a probe, a connection): a config error
        raise ToolConfigError(f"{where}: cannot construct {class_path}: {type(exc).__name__}: {exc}") from None
