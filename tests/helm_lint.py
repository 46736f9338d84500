"""A small static checker for Helm chart templates, for machines without a ``helm`` binary.

It does not execute Go templates. It checks what can be checked from the text:
- every ``{{`` has its ``}}`` and blocks (if/range/with/define/block ... end, else) are balanced;
- every function or keyword used is a Go-template, Sprig or Helm one (catches typos);
- every ``.Values.a.b`` path (also through ``$x := .Values.a`` aliases) exists in values.yaml;
- every ``include``/``template`` names a ``define`` of the chart;
- every ``templates/*.yaml`` is YAML once its actions are replaced by placeholders, with both branches
  of every ``if`` kept, and each document has apiVersion, kind and metadata.name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.S)
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|`[^`]*`')
WORD = re.compile(r"(?<![\w.$])([A-Za-z_]\w*)")
VALUES_REF = re.compile(r"(?<![\w])\$?\.Values((?:\.\w+)+)")
ALIAS_DEF = re.compile(r"\$(\w+)\s*:=\s*\.Values((?:\.\w+)+)")
ALIAS_USE = re.compile(r"\$(\w+)((?:\.\w+)+)")
OPENERS = {"if", "range", "with", "define", "block"}
KNOWN = {
    # Go text/template
    "and", "or", "not", "len", "index", "slice", "print", "printf", "println", "eq", "ne", "lt", "le",
    "gt", "ge", "html", "js", "urlquery", "call", "if", "else", "end", "range", "with", "define",
    "template", "block", "break", "continue", "nil", "true", "false",
    # Helm
    "include", "tpl", "required", "lookup", "toYaml", "fromYaml", "fromYamlArray", "toJson", "fromJson",
    "fromJsonArray", "toToml",
    # Sprig
    "default", "empty", "coalesce", "ternary", "trunc", "trimSuffix", "trimPrefix", "trim", "replace",
    "contains", "hasPrefix", "hasSuffix", "quote", "squote", "upper", "lower", "title", "nindent", "indent",
    "b64enc", "b64dec", "sha256sum", "randAlphaNum", "dict", "list", "get", "set", "unset", "hasKey", "keys",
    "merge", "mergeOverwrite", "deepCopy", "int", "int64", "float64", "toString", "toStrings", "add",
    "sub", "mul", "div", "mod", "max", "min", "until", "join", "split", "splitList", "first", "last",
    "append", "concat", "uniq", "has", "kindIs", "typeOf", "fail", "cat", "regexMatch", "regexReplaceAll", "dig",
    "semverCompare", "now", "date", "genCA", "genSignedCert",
}


@dataclass
class Action:
    line: int
    body: str  # without delimiters, trim markers, strings and comments

    @property
    def keyword(self) -> str:
        words = self.body.split()
        return words[0] if words else ""


def actions(text: str) -> list[Action]:
    out = []
    for m in ACTION.finditer(text):
        body = m.group(2).strip()
        if body.startswith("/*"):
            continue
        out.append(Action(text.count("\n", 0, m.start()) + 1, STRING.sub('""', body)))
    return out


def _strings_in(text: str) -> list[str]:
    return [s[1:-1] for s in STRING.findall(text)]


def delimiter_errors(name: str, text: str) -> list[str]:
    rest = ACTION.sub("", text)
    errors = []
    for token in ("{{", "}}"):
        if token in rest:
            line = text.count("\n", 0, text.find(token) if token in text else 0) + 1
            errors.append(f"{name}:{line}: unmatched {token!r}")
    return errors


def block_errors(name: str, text: str) -> list[str]:
    stack: list[Action] = []
    errors = []
    for act in actions(text):
        if act.keyword in OPENERS:
            stack.append(act)
        elif act.keyword == "else":
            if not stack or stack[-1].keyword not in {"if", "with", "range"}:
                errors.append(f"{name}:{act.line}: else outside if/with/range")
        elif act.keyword == "end":
            if not stack:
                errors.append(f"{name}:{act.line}: end without an open block")
            else:
                stack.pop()
    errors += [f"{name}:{a.line}: {a.keyword} is never closed" for a in stack]
    return errors


def function_errors(name: str, text: str) -> list[str]:
    errors = []
    for act in actions(text):
        for word in WORD.findall(act.body):
            if word not in KNOWN:
                errors.append(f"{name}:{act.line}: unknown function or keyword {word!r}")
    return errors


def _walk(values: Any, path: list[str]) -> bool:
    node = values
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def lookup(values: dict[str, Any], path: list[str]) -> Any:
    node: Any = values
    for key in path:
        node = node[key]
    return node


def value_ref_errors(name: str, text: str, values: dict[str, Any]) -> list[str]:
    errors = []
    aliases: dict[str, list[str]] = {}
    for act in actions(text):
        for var, path in ALIAS_DEF.findall(act.body):
            aliases[var] = path.split(".")[1:]
        refs = [p.split(".")[1:] for p in VALUES_REF.findall(act.body)]
        refs += [aliases[var] + rest.split(".")[1:] for var, rest in ALIAS_USE.findall(act.body) if var in aliases]
        for path in refs:
            if not _walk(values, path):
                errors.append(f"{name}:{act.line}: .Values.{'.'.join(path)} is not in values.yaml")
    return errors


def defines(text: str) -> dict[str, str]:
    """``define`` name -> its body text (nested blocks included)."""
    out: dict[str, str] = {}
    depth = 0
    current: tuple[str, int, int] | None = None
    for m in ACTION.finditer(text):
        words = m.group(2).split()
        if not words or words[0].startswith("/*"):
            continue
        if words[0] in OPENERS:
            depth += 1
            if words[0] == "define" and current is None:
                current = (_strings_in(m.group(2))[0], m.end(), depth)
        elif words[0] == "end":
            if current is not None and depth == current[2]:
                out[current[0]] = text[current[1] : m.start()]
                current = None
            depth -= 1
    return out


def include_errors(name: str, text: str, defined: set[str]) -> list[str]:
    errors = []
    for act in actions(text):
        if act.keyword == "define":
            continue
        raw = re.findall(r'\b(?:include|template)\s+"([^"]+)"', _raw_action_at(text, act.line))
        errors += [f"{name}:{act.line}: include of undefined template {n!r}" for n in raw if n not in defined]
    return errors


def _raw_action_at(text: str, line: int) -> str:
    return " ".join(m.group(2) for m in ACTION.finditer(text) if text.count("\n", 0, m.start()) + 1 == line)


def _is_list(define_body: str) -> bool:
    for line in ACTION.sub("", define_body).splitlines():
        if line.strip():
            return line.lstrip().startswith("- ")
    return False


def strip_to_yaml(text: str, helpers: dict[str, str], values: dict[str, Any]) -> str:
    """Template text with actions replaced by YAML-shaped placeholders (see the module docstring)."""
    out = []
    for n, line in enumerate(text.splitlines()):
        found = list(ACTION.finditer(line))
        if found and not ACTION.sub("", line).strip():
            bodies = [m.group(2).strip() for m in found]
            emitting = [b for b in bodies if re.match(r"(include|toYaml|template)\b", b)]
            if not emitting:
                continue
            body = emitting[0]
            indent = re.search(r"\bn?indent\s+(\d+)", body)
            width = int(indent.group(1)) if indent else len(line) - len(line.lstrip())
            is_list = False
            named = re.match(r'(?:include|template)\s+"([^"]+)"', body)
            if named:
                is_list = _is_list(helpers.get(named.group(1), ""))
            ref = VALUES_REF.search(body)
            if body.startswith("toYaml") and ref and _walk(values, ref.group(1).split(".")[1:]):
                is_list = isinstance(lookup(values, ref.group(1).split(".")[1:]), list)
            out.append(" " * width + ("- tpl_item" if is_list else f"tpl_key_{n}: tpl"))
            continue
        out.append(ACTION.sub("TPL", line))
    return "\n".join(out) + "\n"


def yaml_errors(name: str, text: str, helpers: dict[str, str], values: dict[str, Any]) -> list[str]:
    stripped = strip_to_yaml(text, helpers, values)
    try:
        docs = [d for d in yaml.safe_load_all(stripped) if d is not None]
    except yaml.YAMLError as exc:
        return [f"{name}: not YAML after stripping template actions: {exc}\n{stripped}"]
    errors = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            errors.append(f"{name}: document {i} lacks apiVersion/kind/metadata")
        elif "name" not in (doc["metadata"] or {}):
            errors.append(f"{name}: document {i} ({doc['kind']}) has no metadata.name")
    return errors


def lint_chart(chart: Path) -> list[str]:
    """All problems found in ``chart``'s templates, each as ``file:line: what``."""
    values = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    files = sorted(p for p in (chart / "templates").iterdir() if p.is_file())
    helpers: dict[str, str] = {}
    for path in files:
        helpers.update(defines(path.read_text()))
    errors = []
    for path in files:
        text = path.read_text()
        name = f"templates/{path.name}"
        errors += delimiter_errors(name, text)
        errors += block_errors(name, text)
        errors += function_errors(name, text)
        errors += value_ref_errors(name, text, values)
        errors += include_errors(name, text, set(helpers))
        if path.suffix == ".yaml":
            errors += yaml_errors(name, text, helpers, values)
    return errors
