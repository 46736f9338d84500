"""A real Prometheus for tests, plus the Grafana-dashboard helpers that the integration tests share.

``PrometheusHarness`` runs ``prometheus`` from PATH (Debian's package, which ``make test`` installs) on
127.0.0.1 with a generated config: the scrape jobs of ``deploy/prometheus/prometheus.yml`` (same names,
paths and relabelling) with their targets replaced by the 127.0.0.1 ports a test started, scraped every
second.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
PROJECT_SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "rollwave.json"
LISTENING = re.compile(r'msg="Listening on".*?address=127\.0\.0\.1:(\d+)')




def scrape_config(
    targets: Mapping[str, Sequence[str]],
    base: Path | None = PROJECT_SCRAPE_CONFIG,
    interval: str = "1s",
) -> dict[str, Any]:
    """A Prometheus config scraping ``targets`` (job name -> ``host:port`` list) every ``interval``.

    With ``base``, each job keeps that file's settings (metrics path, relabelling) and only its
    targets change; jobs of ``base`` not named in ``targets`` are dropped, and naming a job that
    ``base`` lacks is an error, so a test cannot drift from the deployed job names.
    """
    jobs: dict[str, dict[str, Any]] = {}
    if base is not None:
        for job in yaml.safe_load(base.read_text())["scrape_configs"]:
            jobs[job["job_name"]] = job
        unknown = sorted(set(targets) - set(jobs))
        if unknown:
            raise ValueError(f"{base}: no scrape job named {unknown}; jobs are {sorted(jobs)}")
    scrape_configs = []
    for name, addrs in targets.items():
        job = {k: v for k, v in jobs.get(name, {"job_name": name}).items() if not k.endswith("_sd_configs")}
        job.pop("static_configs", None)
        job.update(scrape_interval=interval, scrape_timeout=interval, static_configs=[{"targets": list(addrs)}])
        scrape_configs.append(job)
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "scrape_configs": scrape_configs,
    }


class PrometheusHarness:
    """One Prometheus process on 127.0.0.1 with its own config and storage under ``work_dir``.

    ``start()`` returns once ``/-/ready`` answers; ``close()`` stops it (SIGTERM, then SIGKILL).
    """

    def __init__(
        self,
        targets: Mapping[str, Sequence[str]],
        work_dir: Path,
        base: Path | None = PROJECT_SCRAPE_CONFIG,
        interval: str = "1s",
        binary: str = "prometheus",
    ) -> None:
        self.config = scrape_config(targets, base, interval)
        self.work_dir = work_dir
        self.binary = binary
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> PrometheusHarness:
        binary = shutil.which(self.binary)
        if binary is None:
            raise FileNotFoundError(f"{self.binary} not found on PATH: install the Debian package `prometheus` "
                                    "(`make test` does)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        argv = [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            "--web.listen-address=127.0.0.1:0",  # any free port; its log says which
            "--storage.tsdb.retention.time=1h",
            "--log.level=info",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self._log_tail()}")
            if self._client is None and (bound := LISTENING.search(self.log_path.read_text(errors="replace"))):
                self.port = int(bound.group(1))
                self._client = httpx.Client(base_url=self.url, timeout=10.0)
            try:
                if self._client is not None and self._client.get("/-/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"prometheus not ready after {timeout_s}s:\n{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        assert self._client is not None, "start() the harness first"
        reply = self._client.get(path, params=params)
        body = reply.json()
        if reply.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"GET {path} {params}: HTTP {reply.status_code}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query ``expr`` through ``/api/v1/query``; the vector's samples (``metric``, ``value``)."""
        data = self._get("/api/v1/query", {"query": expr})
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll ``expr`` until it returns samples; TimeoutError names the query and the targets' health."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                health = [(t["labels"].get("job"), t["scrapeUrl"], t["health"], t["lastError"])
                          for t in self.targets()]
                raise TimeoutError(f"{expr!r} returned nothing after {timeout_s}s; targets: {health}")
            time.sleep(0.25)

    def targets(self) -> list[dict[str, Any]]:
        return self._get("/api/v1/targets")["activeTargets"]

    def close(self, timeout_s: float = 10.0) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> PrometheusHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def panel_queries(dashboard: Mapping[str, Any]) -> list[str]:
    """Every PromQL ``expr`` of a Grafana dashboard's panels, nested row panels included, in order."""
    queries = []
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append(target["expr"])
        queries.extend(panel_queries(panel))
    return queries


def load_dashboard(path: Path = DASHBOARD) -> dict[str, Any]:
    return json.loads(path.read_text())


def promql_errors(queries: Sequence[str], work_dir: Path) -> list[str]:
    """``promtool check rules`` on one recording rule per query: PromQL parse errors, one per bad query.

    promtool cannot parse a bare expression, but it parses (and type-checks) every rule's ``expr``.
    """
    promtool = shutil.which("promtool")
    if promtool is None:
        raise FileNotFoundError("promtool not found: install the Debian package `prometheus` (`make test` does)")
    errors = []
    for i, expr in enumerate(queries):
        rules = {"groups": [{"name": "check", "rules": [{"record": f"rollwave:check_{i}", "expr": expr}]}]}
        path = work_dir / f"query_{i}.rules.yml"
        path.write_text(yaml.safe_dump(rules))
        done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            errors.append(f"{expr}: {(done.stdout + done.stderr).strip()}")
    return errors
