"""Run the embedded engine as a child process (``python -m rollout_server.engine``) and stop it again.

The listening socket is bound here and handed to the child (``--fd``), so the URL is known before the
child starts and no other process can take the port in between. It starts at weight version ``0``:
rollwave's versions are integers (the pusher numbers them).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from core.config import CONFIG_ERROR_EXIT, ConfigError, EngineConfig
from core.net import listen_socket
from core.process import PARENT_PID_ENV, stop_process
from rollout_server.engine import ENGINE_KEY_ENV

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0


class EngineProcess:
    """One embedded engine server; ``start`` blocks until ``/health`` answers, ``close`` stops it.

    ``api_key`` reaches the child in its environment (not its argv, which any local user can read); every
    caller then sends it (``EngineClient(url, api_key=...)``).
    """

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
        prefix_cache_tokens: int = 16384,
        admit_wait_ms: float = 0.0,
        threads: int = 0,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        api_key: str | None = None,
    ) -> None:
        self.host = host
        self.api_key = api_key
        self.port = port
        self.url = ""
        self._cmd = [
            sys.executable,
            "-m",
            "rollout_server.engine",
            "--model",
            str(model),
            "--weight-version",
            weight_version,
            "--dtype",
            dtype,
            "--max-batch-size",
            str(max_batch_size),
            "--max-context",
            str(max_context),
            "--prefix-cache-tokens",
            str(prefix_cache_tokens),
            "--admit-wait-ms",
            str(admit_wait_ms),
            "--threads",
            str(threads),
            *(extra_args or []),
        ]
        self._log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._log = None

    @classmethod
    def from_config(cls, model: str | Path, cfg: EngineConfig, api_key: str, host: str | None = None
                    ) -> EngineProcess:
        """The embedded engine as the ``engine`` section sets it up; ``host`` (then on any free port) in place of
        ``engine.host`` and ``engine.port``."""
        return cls(model, host=cfg.host if host is None else host, port=cfg.port if host is None else 0,
                   dtype=cfg.dtype, max_batch_size=cfg.max_batch_size, max_context=cfg.max_context,
                   prefix_cache_tokens=cfg.prefix_cache_tokens, admit_wait_ms=cfg.admit_wait_ms,
                   threads=cfg.threads, api_key=api_key)

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"engine at {self.url} was not started")
        return self._proc.pid

    def start(self, timeout_s: float = 120.0) -> EngineProcess:
        """``launch``, then ``wait_ready``."""
        return self.launch().wait_ready(timeout_s)

    def launch(self) -> EngineProcess:
        """Bind (port 0: any free port; a busy fixed one is retried) and start the child, which dies with this
        process (``die_with_parent``), so it is never left behind beside the engine of a restarted server. The
        kernel takes the calling thread's end for this process's: call it on one that lives as long as the engine
        (the main thread, not an ``asyncio.to_thread`` worker)."""
        sock = listen_socket(self.host, self.port, "engine")
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        self._log = open(self._log_path, "ab") if self._log_path else None  # noqa: SIM115
        out = self._log  # None: the engine writes where this process does, so why it died is in this one's log
        env = {k: v for k, v in os.environ.items() if k != ENGINE_KEY_ENV}
        env[PARENT_PID_ENV] = str(os.getpid())
        if self.api_key is not None:
            env[ENGINE_KEY_ENV] = self.api_key
        with sock:  # the child holds its own copy; ours is closed once it runs
            self._proc = subprocess.Popen([*self._cmd, "--fd", str(sock.fileno())], stdout=out,
                                          stderr=subprocess.STDOUT, pass_fds=(sock.fileno(),), env=env)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> EngineProcess:
        """Wait up to ``timeout_s`` for the launched engine's /health (``engine.ready_timeout_s``), logging every
        30 s that it still waits; stop it if it does not answer in time."""
        if self._proc is None:
            raise RuntimeError(f"engine at {self.url} was not launched")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        started = time.monotonic()
        next_log = started + PROGRESS_EVERY_S
        while (now := time.monotonic()) < started + timeout_s:
            if now >= next_log:  # a big checkpoint takes a while to load: say that it is still coming
                log.info("waiting for the engine at %s to be healthy: %.0f s of %.0f s", self.url, now - started,
                         timeout_s)
                next_log += PROGRESS_EVERY_S
            if self._proc.poll() is not None:
                self._exited()
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=5.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"engine at {self.url} not healthy after {timeout_s:.0f}s")

    def _exited(self) -> None:
        """Raise for an engine that exited before it was healthy: ``ConfigError`` for one that refused its start
        (``CONFIG_ERROR_EXIT``: its model or settings; starting it again cannot help), RuntimeError otherwise."""
        code = self._proc.returncode if self._proc is not None else None
        where = f"in {self._log_path}" if self._log_path else "above"
        if code == CONFIG_ERROR_EXIT:
            raise ConfigError(f"engine: the embedded engine refused to start (its error is {where}): "
                              f"{' '.join(self._cmd)}")
        raise RuntimeError(f"engine exited with code {code} (its error is {where}): {' '.join(self._cmd)}")

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
