"""Run the embedded engine as a child process (``python -m rollout_server.engine``) and stop it again.

It starts at weight version ``0``: rollwave's versions are integers (the pusher numbers them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from core.net import free_port
from core.process import stop_process


class EngineProcess:
    """One embedded engine server; ``start`` blocks until ``/health`` answers, ``close`` stops it."""

    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        weight_version: str = "0",
        dtype: str = "auto",
        max_batch_size: int = 64,
        max_context: int = 1024,
        threads: int = 0,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self._cmd = [
            sys.executable,
            "-m",
            "rollout_server.engine",
            "--model",
            str(model),
            "--host",
            host,
            "--port",
            str(self.port),
            "--weight-version",
            weight_version,
            "--dtype",
            dtype,
            "--max-batch-size",
            str(max_batch_size),
            "--max-context",
            str(max_context),
            "--threads",
            str(threads),
            *(extra_args or []),
        ]
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"engine at {self.url} was not started")
        return self._proc.pid

    def start(self, timeout_s: float = 120.0) -> EngineProcess:
        self._log = open(self._log_path, "ab") if self._log_path else None  # noqa: SIM115
        out = self._log or subprocess.DEVNULL
        self._proc = subprocess.Popen(self._cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self._proc.returncode}: {' '.join(self._cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"engine at {self.url} not healthy after {timeout_s:.0f}s")

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), SIGKILL if it lingers."""
        if self._proc is not None:
            stop_process(self._proc, timeout_s, name=f"engine {self.url}")
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
