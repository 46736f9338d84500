"""Importing the operator's code that a config names by ``module:name`` (tools, reward functions, agents).

A module may raise anything as it is imported (a SyntaxError, a RuntimeError of its own, a dependency it lacks):
every such failure becomes one ImportError naming the module, the exception and the ``file:line`` that raised, which
the loader words as its config key's error, rather than a traceback that stops the component (and a supervisor
that starts it again, only for it to fail the same way).
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any


def import_object(path: str) -> Any:
    """The object ``path`` (``module:name`` or ``module.name``) names. ModuleNotFoundError, as Python words it, when
    the module itself is not on the path; ImportError naming what failed for anything else."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"{path!r} is not an import path (module:name)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{module_name}.".startswith(f"{exc.name}."):
            raise  # the module named, or a package above it
        raise ImportError(f"importing {module_name} raised {_raised(exc)}") from exc
    except Exception as exc:  # the operator's module, running anything as it is imported
        raise ImportError(f"importing {module_name} raised {_raised(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"module {module_name!r} has no attribute {attr!r}") from None


def _raised(exc: BaseException) -> str:
    """``Type: message (file:line)``: where the import failed (the innermost frame; a SyntaxError's own line)."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
