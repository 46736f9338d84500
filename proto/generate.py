"""Regenerate the Python stubs of every .proto here (``make proto``).

Run from the repository root so the stubs import each other as ``proto.<name>_pb2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Write ``proto/*_pb2.py`` and ``*_pb2_grpc.py`` under ``out_dir``; return the files written."""
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    sources = sorted((ROOT / "proto").glob("*.proto"))
    (out_dir / "proto").mkdir(parents=True, exist_ok=True)
    for src in sources:
        rel = src.relative_to(ROOT)
        rc = protoc.main(
            ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
             f"--grpc_python_out={out_dir}", str(rel)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed on {rel} (exit {rc})")
    return sorted(p for p in (out_dir / "proto").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(ROOT))
    sys.exit(0)
