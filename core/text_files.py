"""Reading the text files users write (run configs, job files, tool configs, secret files, task files).

Every reader here decodes strict UTF-8 and, when a file is not what it should be, raises ``TextFileError``
naming ``file:line``: ``cfg.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)``, ``cfg.yaml:3: duplicate
key 'run' (first on line 1)``, ``cfg.yaml:2: not valid YAML: ...``. It is a ValueError, so a command line
shows it as an input error; loaders with their own error type re-raise it as that. A missing or unreadable
file is the OSError ``open`` raises, left to the caller to word.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class TextFileError(ValueError):
    """A file that is not valid UTF-8, or not the YAML it should be; the message names ``file:line``."""


def _not_utf8(data: bytes, exc: UnicodeDecodeError, path: str | Path, first_line: int = 1) -> TextFileError:
    """The error for the first byte of ``data`` that is not UTF-8: its line, and its column in characters."""
    start = exc.start
    line_start = data.rfind(b"\n", 0, start) + 1
    line = first_line + data.count(b"\n", 0, start)
    before = data[line_start:start]
    if line_start == 0:
        before = before.removeprefix(codecs.BOM_UTF8)  # no editor counts the mark as a column
    column = len(before.decode("utf-8", errors="replace")) + 1
    return TextFileError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[start]:02x} at column {column})")


def decode_utf8(data: bytes, path: str | Path, *, bom: bool = False, first_line: int = 1) -> str:
    """``data`` as UTF-8 text (with ``bom``, a leading byte order mark is dropped); TextFileError naming
    ``path:line`` (``first_line`` is the line ``data`` starts on) and the column of the first bad byte."""
    try:
        return data.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as exc:
        if bom and data.startswith(codecs.BOM_UTF8):  # utf-8-sig's position counts from after the mark
            exc = UnicodeDecodeError(exc.encoding, data, exc.start + 3, exc.end + 3, exc.reason)
        raise _not_utf8(data, exc, path, first_line) from None


def read_text(path: str | Path, *, bom: bool = False) -> str:
    """A whole UTF-8 file (see ``decode_utf8``); OSError as ``open`` raises it."""
    return decode_utf8(Path(path).read_bytes(), path, bom=bom)


def utf8_lines(lines: Iterable[bytes], path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a file opened in binary mode, each line decoded as UTF-8 (a byte order mark
    is kept, as a text-mode ``open(encoding="utf-8")`` keeps it); TextFileError naming the line that is not."""
    for lineno, raw in enumerate(lines, start=1):
        yield lineno, decode_utf8(raw, path, first_line=lineno)


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping that names a key twice (PyYAML would silently keep the last one)."""


class StrictSafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (a ``<<`` merge may still be
    overridden, as YAML intends)."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.setdefault(key, key_node)
                except TypeError:  # unhashable: the base class names it
                    continue
                if earlier is not key_node:
                    raise DuplicateKeyError(
                        None, None, f"duplicate key {key!r} (first on line {earlier.start_mark.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, path: str | Path) -> Any:
    """YAML ``text`` read from ``path``: safe, and no key twice in a mapping; TextFileError naming ``path:line``."""
    try:
        return yaml.load(text, Loader=StrictSafeLoader)  # noqa: S506 - a SafeLoader
    except DuplicateKeyError as exc:
        raise TextFileError(f"{path}:{exc.problem_mark.line + 1}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise TextFileError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None


def load_yaml(path: str | Path) -> Any:
    """A YAML file (UTF-8, a byte order mark allowed): ``parse_yaml`` of its text; OSError as ``open`` raises it."""
    return parse_yaml(read_text(path, bom=True), path)


def yaml_key_lines(path: str | Path) -> dict[tuple[str, ...], int]:
    """The line of every key and list item of a YAML file that ``load_yaml`` read, by its path of keys and
    indices as text (``("trainer", "lr")``, ``("tools", "0")``), so that an error found in the loaded value
    can name ``file:line``. Empty when the file no longer parses."""
    try:
        root = yaml.compose(read_text(path, bom=True), Loader=yaml.SafeLoader)
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    lines: dict[tuple[str, ...], int] = {}
    todo: list[tuple[tuple[str, ...], yaml.Node | None]] = [((), root)]
    while todo:
        where, node = todo.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.tag != _MERGE_TAG and isinstance(key, yaml.ScalarNode):
                    lines.setdefault((*where, key.value), key.start_mark.line + 1)
                    todo.append(((*where, key.value), value))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*where, str(i))] = item.start_mark.line + 1
                todo.append(((*where, str(i)), item))
    return lines


def line_of(lines: dict[tuple[str, ...], int], loc: Iterable[object]) -> int | None:
    """The line of the deepest key of ``loc`` (a validation error's location) that the file has, or None."""
    parts = tuple(str(p) for p in loc)
    for end in range(len(parts), 0, -1):
        if (line := lines.get(parts[:end])) is not None:
            return line
    return None


def lone_surrogate_at(value: Any) -> tuple[int | str, ...] | None:
    """Where in a JSON value a string, or a key (then its object's place), holds half a UTF-16 pair, or None. JSON's
    ``"\\ud800"`` escapes read as one (Python's parser takes it), and no UTF-8 text can carry it: a tokenizer, or a
    JSON writer, fails on it. Walked without recursion, in the order the value is written: a body may nest as deep
    as the JSON parser goes."""
    stack: list[tuple[Any, tuple[int | str, ...]]] = [(value, ())]
    while stack:
        item, loc = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return loc
        elif isinstance(item, dict):
            if not all(_encodes(key) for key in item if isinstance(key, str)):
                return loc
            stack.extend(reversed([(child, (*loc, key)) for key, child in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(child, (*loc, i)) for i, child in enumerate(item)]))
    return None


def json_path(loc: Iterable[int | str]) -> str:
    """A place in a JSON value as a user writes it: ``messages[1].tool_calls[0].function``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
