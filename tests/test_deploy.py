"""Deployment files checked as far as a machine without Docker, Kubernetes or helm allows.

What is checked:
- docker-compose.yml validates against the Compose Specification JSON schema (vendored in tests/data);
  its references resolve (services, volumes, bind-mounted files, Dockerfiles); the profiles hold what
  they promise (embedded engine on CPU; SGLang servers with GPU reservations on GPU); every rollwave
  command's overrides load with the run config through core.config; Prometheus targets are
  compose services on the ports they expose. Security: secrets have no defaults and reach each
  container, only its own, in its environment; engines listen on loopback (the embedded one a child,
  each SGLang server sharing its rollout server's network namespace); only the trainer mounts runs/
  and nothing but model-init writes the models; the checkpoint plane is mutual TLS with the certificates
  the checkpoint-tls job makes (its command runs here, and a handshake uses what it made).
- The Dockerfiles COPY every package and only files that exist and that their .dockerignore lets
  through, install torch from the CPU index (CPU image) and never reinstall it (GPU image), install
  bubblewrap and run as an unprivileged uid. Images are not built here.
- prometheus.yml passes `promtool check config`; every Grafana panel query parses with promtool
  (as a recording rule); the dashboard covers the design's signals and names metrics that the
  components define; provisioning points at the dashboard and datasource that exist.
- The Helm chart: Chart.yaml, values.yaml against values.schema.json (and the schema rejects bad
  values), the static template checks of tests/helm_lint.py (with a test that they catch each kind of
  breakage), and every run-config key the chart sets exists in core.config. Rendering with the
  real Helm engine is in tests/test_helm_render.py.

Not checked here: that images build and containers start (`make test-deploy`, tests/deploy/run.py, does
that with Docker), and that Prometheus queries return data from a live stack (the integration test does
that with tests/prometheus_harness.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helm_lint import lint_chart
from prometheus_harness import load_dashboard, panel_queries, promql_errors
from pydantic import BaseModel
from tls_handshake import handshakes

from core.config import SECRETS, Config, load_config, require_secret
from core.net import is_loopback

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "rollwave"
COMPOSE = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
JOBS = {"rollwave-api", "rollwave-trainer", "rollwave-rollout", "rollwave-engine"}
DS_UID = "rollwave-prometheus"


def _interpolate(text: str) -> str:
    """Compose's ``${VAR:-default}`` with no environment: the default (``${VAR:?error}``: empty)."""
    return re.sub(r"\$\{(\w+)(?::?([-?])([^}]*))?\}", lambda m: m.group(3) if m.group(2) == "-" else "", text)


def _config_key_exists(dotted: str) -> bool:
    model: type[BaseModel] = Config
    *sections, leaf = dotted.split(".")
    for part in sections:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return False
        model = field.annotation
    return leaf in model.model_fields


def _rollwave_commands() -> dict[str, list[str]]:
    """Services that run a rollwave module with the mounted run config: name -> interpolated command."""
    out = {}
    for name, svc in SERVICES.items():
        cmd = [_interpolate(str(a)) for a in svc.get("command") or []]
        if "/config/run.yaml" in cmd:
            out[name] = cmd
    return out


# ---- docker-compose ---------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    schema = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(COMPOSE)]
    assert errors == []


def test_compose_references_resolve() -> None:
    declared_volumes = set(COMPOSE["volumes"])
    for name, svc in SERVICES.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in SERVICES, f"{name}: depends_on unknown service {dep}"
        for mount in svc.get("volumes") or []:
            source = mount.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: bind mount {source} does not exist"
            else:
                assert source in declared_volumes, f"{name}: volume {source} is not declared"
        if "build" in svc:
            context = DEPLOY / svc["build"]["context"]
            assert (context / svc["build"]["dockerfile"]).is_file(), f"{name}: Dockerfile missing"
        for port in svc.get("ports") or []:
            assert re.fullmatch(r"127\.0\.0\.1:\d+:\d+", port), f"{name}: publish {port} on 127.0.0.1 explicitly"
        for port in svc.get("expose") or []:
            assert re.fullmatch(r"\d+", port), f"{name}: expose {port!r} is not one explicit port"


def test_compose_redis_keeps_an_append_only_file_and_everyone_uses_it() -> None:
    redis = SERVICES["redis"]
    assert redis["image"].startswith("redis:7")
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    for name in _rollwave_commands():
        assert SERVICES[name]["environment"]["REDIS_URL"] == "redis://redis:6379/0", name
        assert SERVICES[name]["environment"]["OMP_WAIT_POLICY"] == "PASSIVE", name  # unpinned: idle threads sleep
    assert load_config(DEPLOY / "config" / "run.yaml").redis.url == "redis://redis:6379/0"


def test_compose_profiles_run_the_embedded_engine_on_cpu_and_sglang_on_gpu() -> None:
    def in_profile(profile: str) -> dict[str, dict[str, Any]]:
        return {n: s for n, s in SERVICES.items() if profile in (s.get("profiles") or [])}

    cpu, gpu = in_profile("cpu"), in_profile("gpu")
    always = {n for n, s in SERVICES.items() if not s.get("profiles")}
    assert {"redis", "prometheus", "grafana", "api"} <= always

    def commands(services: dict[str, dict[str, Any]], word: str) -> dict[str, list[str]]:
        return {n: [_interpolate(str(a)) for a in s["command"]] for n, s in services.items()
                if word in s["command"]}

    cpu_rollout = commands(cpu, "rollout_server")
    assert cpu_rollout and all("engine.backend=embedded" in c for c in cpu_rollout.values())
    assert commands(cpu, "trainer")
    assert not any(s.get("deploy") for s in cpu.values()), "the cpu profile must not reserve GPUs"

    engines = commands(gpu, "sglang.launch_server")
    assert len(engines) >= 2
    for name in [*engines, *commands(gpu, "trainer")]:
        [device] = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
    gpu_rollout = commands(gpu, "rollout_server")
    assert len(gpu_rollout) == len(engines)
    used = set()
    for name, cmd in gpu_rollout.items():
        assert "engine.backend=sglang" in cmd, name
        engine = gpu[name]["network_mode"].removeprefix("service:")  # one network namespace, like a pod
        assert engine in engines, f"{name} shares no SGLang server's network namespace"
        [url] = load_config(None, [a for a in cmd if a.startswith("engine.urls=")]).engine.urls
        port = re.fullmatch(r"http://127\.0\.0\.1:(\d+)", url).group(1)
        assert f"--port={port}" in engines[engine] and "--host=127.0.0.1" in engines[engine], name
        assert f"rollout.grpc_host={engine}" in cmd and "50051" in gpu[engine]["expose"], name
        used.add(engine)
    assert used == set(engines), "every SGLang server has a rollout server"


def test_compose_restarts_a_trainer_that_failed_never_one_that_finished() -> None:
    """A trainer that reached trainer.total_steps exits 0; unless-stopped restarted it, and it reloaded the model, found
    its steps done and ended again, for ever. The long-running services stay unless-stopped."""
    services = COMPOSE["services"]
    for name, svc in services.items():
        if name.startswith("trainer"):
            assert svc["restart"] == "on-failure", name
        elif name not in ("model-init", "checkpoint-tls"):
            assert svc["restart"] == "unless-stopped", name


def test_compose_commands_load_with_the_run_config() -> None:
    commands = _rollwave_commands()
    assert {"api", "trainer", "rollout-cpu-0", "rollout-gpu-0", "trainer-gpu"} <= set(commands)
    for name, cmd in commands.items():
        start = cmd.index("-c") + 2
        overrides = [a for a in cmd[start:] if "=" in a and not a.startswith("-")]
        cfg = load_config(DEPLOY / "config" / "run.yaml", overrides)
        assert cfg.run.name == "compose", name
        assert cfg.rollout.metrics_host == cfg.trainer.metrics_host == "0.0.0.0", f"{name}: Prometheus cannot scrape"


def test_compose_commands_name_modules_that_exist() -> None:
    for name, cmd in _rollwave_commands().items():
        module = cmd[cmd.index("-m") + 1]
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), (
            f"{name}: `python -m {module}` has no module file"
        )


def test_prometheus_targets_are_compose_services_on_exposed_ports() -> None:
    for job in PROMETHEUS["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, port = target.split(":")
                if host == "localhost":
                    continue
                svc = SERVICES.get(host)
                assert svc is not None, f"{job['job_name']}: target {target} is not a compose service"
                published = [p.split(":")[-1] for p in svc.get("ports") or []]
                exposed = [str(p) for p in svc.get("expose") or []]
                assert port in exposed + published, f"{job['job_name']}: {host} does not expose {port}"
                cmd = " ".join(_interpolate(str(a)) for a in svc.get("command") or [])
                if job["job_name"] in {"rollwave-rollout", "rollwave-trainer"}:
                    assert f"metrics_port={port}" in cmd or port in (DEPLOY / "config" / "run.yaml").read_text()


NEEDS = {"services.api": "ROLLWAVE_API_TOKEN", "trainer": "ROLLWAVE_CHECKPOINT_TOKEN",
         "rollout_server": "ROLLWAVE_CHECKPOINT_TOKEN"}


def test_compose_hands_each_container_only_its_own_secret_from_the_environment() -> None:
    raw = (DEPLOY / "docker-compose.yml").read_text()
    assert "rollwave-dev-token" not in raw and "ROLLWAVE_TOKEN" not in raw
    for name, cmd in _rollwave_commands().items():
        module = cmd[cmd.index("-m") + 1]
        env = SERVICES[name]["environment"]
        secrets = {k: v for k, v in env.items() if k in SECRETS.values()}
        assert secrets == {var: f"${{{var}:?set {var} to 32+ random characters (deploy/README.md)}}"
                           for var in (NEEDS[module], "ROLLWAVE_REDIS_PASSWORD")}, name  # no defaults
        assert not [a for a in cmd if "token" in a or "api_key" in a], f"{name}: a secret on the command line"
        start = cmd.index("-c") + 2
        overrides = [a for a in cmd[start:] if "=" in a and not a.startswith("-")]
        cfg = load_config(DEPLOY / "config" / "run.yaml", overrides,
                          env={NEEDS[module]: "x" * 40, "ROLLWAVE_REDIS_PASSWORD": "r" * 40})
        key = "api.token" if module == "services.api" else "checkpoint.token"
        assert require_secret(cfg, key) == "x" * 40, name
        assert cfg.redis.username == "rollwave" and require_secret(cfg, "redis.password") == "r" * 40, name


def test_compose_gives_no_secret_to_containers_that_log_in_nowhere() -> None:
    """Only Redis (which writes its ACL from the password) and the rollwave components (above) get a secret:
    the model-init and checkpoint-tls jobs, SGLang, Prometheus and Grafana get none."""
    components = set(_rollwave_commands())
    for name, svc in SERVICES.items():
        secrets = set(svc.get("environment") or {}) & set(SECRETS.values())
        if name == "redis":
            assert secrets == {"ROLLWAVE_REDIS_PASSWORD"}
        elif name not in components:
            assert not secrets, f"{name} gets {sorted(secrets)}"


def test_compose_keeps_engines_on_loopback() -> None:
    for name, svc in SERVICES.items():
        cmd = [_interpolate(str(a)) for a in svc.get("command") or []]
        assert "30000" not in [str(p) for p in svc.get("expose") or []] and not svc.get("ports", [""])[0].endswith(
            ":30000"), name
        assert not [a for a in cmd if a.startswith(("engine.host=", "--host=0", "engine.urls=[http://sglang"))], name
        if "/config/run.yaml" in cmd:
            overrides = [a for a in cmd[cmd.index("-c") + 2:] if "=" in a and not a.startswith("-")]
            assert is_loopback(load_config(DEPLOY / "config" / "run.yaml", overrides, env={}).engine.host), name


def test_compose_mounts_what_each_container_needs_and_no_more() -> None:
    for name, svc in SERVICES.items():
        mounts = {v.split(":")[0]: v for v in svc.get("volumes") or []}
        if "models" in mounts:
            assert mounts["models"].endswith(":ro") == (name != "model-init"), f"{name}: {mounts['models']}"
        if "runs" in mounts:  # checkpoints (loaded on --resume): written and read by the trainer only
            assert "trainer" in [_interpolate(str(a)) for a in svc["command"]], name


def _run_config(cmd: list[str]) -> Config:
    overrides = [a for a in cmd[cmd.index("-c") + 2:] if "=" in a and not a.startswith("-")]
    return load_config(DEPLOY / "config" / "run.yaml", overrides, env={})


def test_compose_checkpoint_plane_is_mutual_tls_with_the_certificates_it_makes(tmp_path: Path) -> None:
    """The checkpoint-tls job's command, run as compose runs it, makes a CA (its key not kept), the receiver's
    and the trainer's certificates, readable by their owner only, and keeps them when run again; it hands each
    role its own certificate, key and ca.crt in a volume of its own. Every rollout server mounts the receivers'
    volume and every trainer the trainers', read-only, and waits for the job, so no rollout server holds the
    trainers' key (which names the client the receivers let in). With the files where the containers see them,
    a receiver configured as the rollout servers are and a pusher configured as the trainers are complete a
    mutual TLS handshake at an IP address, which fails if the pusher checks that address instead of
    checkpoint.tls_server_name, or presents the receiver's certificate."""
    job = SERVICES["checkpoint-tls"]
    assert job["command"][:4] == ["python", "-m", "core.checkpoint_pki", "/tls"]
    mounts = dict(v.split(":") for v in job["volumes"])
    assert mounts == {"checkpoint-tls": "/tls", "checkpoint-tls-trainer": "/tls-trainer",
                      "checkpoint-tls-receiver": "/tls-receiver"}
    assert not set(job["environment"]) & set(SECRETS.values())
    local_dir = {volume: tmp_path / volume for volume in mounts}
    in_job = {path: str(local_dir[volume]) for volume, path in mounts.items()}
    here = [re.sub(r"^(\w+=)?(/tls[\w-]*)$", lambda m: (m[1] or "") + in_job[m[2]], a) for a in job["command"][3:]]
    command = [sys.executable, *job["command"][1:3], *here]
    subprocess.run(command, check=True, capture_output=True, timeout=60, cwd=REPO)

    def files(volume: str) -> dict[str, int]:
        return {p.name: p.stat().st_mode & 0o777 for p in local_dir[volume].iterdir()}

    assert files("checkpoint-tls") == dict.fromkeys(
        ["ca.crt", "receiver.crt", "receiver.key", "trainer.crt", "trainer.key"], 0o600)
    assert files("checkpoint-tls-trainer") == dict.fromkeys(["ca.crt", "trainer.crt", "trainer.key"], 0o600)
    assert files("checkpoint-tls-receiver") == dict.fromkeys(["ca.crt", "receiver.crt", "receiver.key"], 0o600)
    ca = (local_dir["checkpoint-tls"] / "ca.crt").read_bytes()
    again = subprocess.run([*command[:4], "other-name", *command[5:]], check=True, capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert "keeping" in again.stdout and (local_dir["checkpoint-tls-receiver"] / "ca.crt").read_bytes() == ca

    def local(cfg: Config, volume: str) -> Config:  # the paths under /tls, where this test has that volume
        moved = {k: local_dir[volume] / Path(getattr(cfg.checkpoint, k)).relative_to("/tls")
                 for k in ("tls_cert", "tls_key", "tls_ca")}
        return cfg.checkpoint.model_copy(update=moved)

    receivers, pushers = [], []
    for name, cmd in _rollwave_commands().items():
        module = cmd[cmd.index("-m") + 1]
        if module == "services.api":
            continue
        svc = SERVICES[name]
        volume = "checkpoint-tls-receiver" if module == "rollout_server" else "checkpoint-tls-trainer"
        assert [v for v in svc["volumes"] if "/tls" in v] == [f"{volume}:/tls:ro"], name
        assert svc["depends_on"]["checkpoint-tls"] == {"condition": "service_completed_successfully"}, name
        cfg = _run_config(cmd)
        assert cfg.checkpoint.tls_server_name == "rollwave-checkpoint-receiver", name
        (receivers if module == "rollout_server" else pushers).append(local(cfg, volume))
    assert len(receivers) == 3 and len(pushers) == 2
    assert {r.tls_cert.name for r in receivers} == {"receiver.crt"}
    assert {p.tls_cert.name for p in pushers} == {"trainer.crt"}
    assert all(r.tls_cert.is_file() and r.tls_key.is_file() for r in [*receivers, *pushers])
    assert handshakes(receivers[0], pushers[0])
    assert not handshakes(receivers[0], pushers[0].model_copy(update={"tls_server_name": None}))
    as_receiver = {"tls_cert": receivers[0].tls_cert, "tls_key": receivers[0].tls_key}
    assert not handshakes(receivers[0], pushers[0].model_copy(update=as_receiver))


# ---- Dockerfiles ------------------------------------------------------------------------------


def _dockerfile(name: str) -> tuple[list[str], list[str]]:
    text = (DEPLOY / name).read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    return lines, [ln for ln in ignore if ln and not ln.startswith("#")]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_files_that_exist_and_are_sent(name: str) -> None:
    lines, ignore = _dockerfile(name)
    allowed = {p[1:].rstrip("*").rstrip("/") for p in ignore if p.startswith("!")}
    assert ignore[0] == "**", "the .dockerignore is an allowlist"
    copies = [ln.split()[1:-1] for ln in lines if ln.startswith("COPY ")]
    assert copies
    for sources in copies:
        for src in sources:
            assert (REPO / src).exists(), f"{name}: COPY {src} does not exist"
            assert src.rstrip("/") in allowed, f"{name}: COPY {src} is excluded by {name}.dockerignore"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_images_hold_every_package_run_unprivileged_and_can_sandbox(name: str) -> None:
    lines, _ = _dockerfile(name)
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    copied = {ln.split()[1].rstrip("/") for ln in lines if ln.startswith("COPY ")}
    assert {p.rstrip("*") for p in packages["include"]} <= copied
    [user] = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    uid, _, gid = user.partition(":")
    assert int(uid) >= 1000 and int(gid) >= 1000, "a numeric, unprivileged uid:gid (Kubernetes checks runAsNonRoot)"
    assert lines.index(f"USER {user}") > max(i for i, ln in enumerate(lines) if ln.startswith("RUN "))
    assert any("apt-get install" in ln and "bubblewrap" in ln for ln in lines), "the python tool's sandbox"
    cmd = next(ln for ln in lines if ln.startswith("CMD "))
    assert "0.0.0.0" not in cmd and "30000" not in next(ln for ln in lines if ln.startswith("EXPOSE "))


@pytest.mark.parametrize("index", [None, "https://download.pytorch.org/whl/cpu"])
def test_make_install_takes_torch_from_torch_index_url(index: str | None) -> None:
    """``make install`` pins torch; ``TORCH_INDEX_URL`` (for an index whose torch is the CUDA build) is where
    pip gets it, and only it: the project's other packages keep pip's index."""
    args = ["make", "-n", "-B", "install"] + ([f"TORCH_INDEX_URL={index}"] if index else [])
    lines = subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True).stdout.splitlines()
    [torch] = [ln for ln in lines if "pip" in ln and "torch==" in ln]
    assert ("--index-url" in torch) == bool(index) and (index or "") in torch
    assert not [ln for ln in lines if "--index-url" in ln and ln != torch]


def test_cpu_image_pins_the_cpu_torch_build() -> None:
    lines, _ = _dockerfile("Dockerfile")
    assert lines[:2] == ["ARG BASE_IMAGE=python:3.11-slim", "FROM ${BASE_IMAGE}"]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in lines
    assert "ARG PIP_INDEX_URL=https://pypi.org/simple" in lines
    installs = [ln for ln in lines if "pip install" in ln]
    assert any('--index-url "$TORCH_INDEX_URL" torch==2.13.0' in ln for ln in installs)
    assert all("-c constraints.txt" in ln for ln in installs)


def test_gpu_image_builds_on_sglang_without_reinstalling_torch() -> None:
    lines, _ = _dockerfile("Dockerfile.gpu")
    assert lines[0].startswith("ARG SGLANG_IMAGE=lmsysorg/sglang:")
    assert "FROM ${SGLANG_IMAGE}" in lines
    installs = [ln.split("pip install", 1)[1].split("&&")[0] for ln in lines if "pip install" in ln]
    assert installs and not any("torch" in args for args in installs)
    assert any("-c /tmp/image-pins.txt" in ln for ln in installs), "pins the image's own packages"


# ---- Prometheus and Grafana -------------------------------------------------------------------


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: install the Debian package `prometheus` (`make test` does)"
    path = DEPLOY / "prometheus" / "prometheus.yml"
    done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert JOBS <= {job["job_name"] for job in PROMETHEUS["scrape_configs"]}


def test_grafana_provisioning_points_at_the_dashboard_and_datasource() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    [ds] = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert ds["uid"] == DS_UID and ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((prov / "dashboards" / "rollwave.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    env = SERVICES["grafana"]["environment"]  # anonymous viewers only: no admin/admin account to log in with
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert env["GF_SECURITY_DISABLE_INITIAL_ADMIN_CREATION"] == env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"
    assert not any("PASSWORD" in key for key in env)


def test_dashboard_panels_are_well_formed() -> None:
    dash = load_dashboard()
    assert dash["uid"] == "rollwave"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(graphs) >= 11
    for panel in graphs:
        assert panel["datasource"]["uid"] == DS_UID, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"]["uid"] == DS_UID and t["expr"].strip() for t in panel["targets"])
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]


def test_every_panel_query_parses(tmp_path: Path) -> None:
    queries = panel_queries(load_dashboard())
    assert len(queries) >= 20
    assert promql_errors(queries, tmp_path) == []


def test_promql_check_reports_a_broken_query(tmp_path: Path) -> None:
    [error] = promql_errors(["sum(rate(rollwave_x_total[1m])", "up"], tmp_path)
    assert error.startswith("sum(rate(rollwave_x_total[1m]):")


SIGNALS = {
    "reward": ["rollwave_trainer_reward_mean"],
    "staleness": ["rollwave_trainer_staleness_bucket", "rollwave_buffer_stale_dropped_total"],
    "throughput": ["rollwave_rollout_generated_tokens_total", "rollwave_rollout_groups_completed_total",
                   "rollwave_engine_generated_tokens_total"],
    "pause time": ["rollwave_rollout_pause_duration_seconds_sum", "rollwave_rollout_paused_seconds_total"],
    "versions": ["rollwave_trainer_policy_version", "rollwave_rollout_policy_version"],
    "buffer depth": ["rollwave_buffer_depth", "rollwave_buffer_pending", "rollwave_buffer_dead_letters_total"],
    "tool errors": ["rollwave_rollout_tool_calls_total"],
    "trainer idle": ["rollwave_trainer_idle_seconds_total"],
    "off-policy": ["rollwave_trainer_is_ratio_mean", "rollwave_trainer_is_ratio_max",
                   "rollwave_trainer_clip_fraction"],
    "weight staging": ["rollwave_rollout_stage_bytes_total", "rollwave_rollout_stage_duration_seconds_sum"],
}
METRIC = re.compile(r"\brollwave_[a-z0-9_]+\b")


def _dashboard_metrics() -> set[str]:
    return {m for q in panel_queries(load_dashboard()) for m in METRIC.findall(q)}


def test_dashboard_covers_the_design_signals() -> None:
    used = _dashboard_metrics()
    missing = {signal: [m for m in names if m not in used] for signal, names in SIGNALS.items()}
    assert {k: v for k, v in missing.items() if v} == {}


def _exposed_series() -> dict[str, str]:
    """Series name -> component class, for every metric the components register."""
    from buffer.metrics import BufferMetrics
    from rollout_server.checkpoint_receiver import CheckpointMetrics
    from rollout_server.engine.metrics import EngineMetrics
    from rollout_server.metrics import RolloutMetrics
    from trainer.checkpoint_pusher import PushMetrics
    from trainer.metrics import TrainerMetrics

    suffixes = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"],
                "summary": ["", "_sum", "_count"]}
    series = {}
    for cls in (RolloutMetrics, CheckpointMetrics, EngineMetrics, BufferMetrics, TrainerMetrics, PushMetrics):
        for family in cls().registry.collect():
            for suffix in suffixes[family.type]:
                series[family.name + suffix] = cls.__name__
    return series


def test_dashboard_metrics_are_registered_by_the_components() -> None:
    """Each series a panel reads is one a component registers, with the right type: ``_total`` of a
    counter, ``_bucket/_sum/_count`` of a histogram, the bare name of a gauge."""
    exposed = _exposed_series()
    assert sorted(m for m in _dashboard_metrics() if m not in exposed) == []


# ---- Helm chart -------------------------------------------------------------------------------


def _values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == CHART.name and chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_values_match_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert list(jsonschema.Draft7Validator(schema).iter_errors(_values())) == []


@pytest.mark.parametrize(
    "patch, where",
    [
        ({"engine": {"backend": "cuda"}}, "engine/backend"),
        ({"redis": {"url": "http://redis:6379"}}, "redis/url"),
        ({"rollout": {"replicas": -1}}, "rollout/replicas"),
        ({"trainer": {"gpusPerNode": "two"}}, "trainer/gpusPerNode"),
        ({"api": {"prot": 8000}}, "api"),
        ({"tokn": {}}, ""),
    ],
)
def test_schema_rejects_bad_values(patch: dict[str, Any], where: str) -> None:
    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if isinstance(value, dict) and key in base else value
        return out

    schema = json.loads((CHART / "values.schema.json").read_text())
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(merge(_values(), patch)))
    assert errors and "/".join(map(str, errors[0].absolute_path)) == where


def test_templates_pass_the_static_checks() -> None:
    assert lint_chart(CHART) == []


@pytest.mark.parametrize(
    "file, old, new, expected",
    [
        ("api.yaml", "| nindent 12", "| nindnet 12", "unknown function or keyword 'nindnet'"),
        ("api.yaml", ".Values.api.port", ".Values.api.prot", ".Values.api.prot is not in values.yaml"),
        ("redis.yaml", "$redis.image.tag", "$redis.image.tga", ".Values.redis.bundled.image.tga is not in"),
        ("secret.yaml", "{{- end }}", "", "if is never closed"),
        ("trainer.yaml", '"rollwave.env"', '"rollwave.environment"', "undefined template 'rollwave.environment'"),
        ("configmap.yaml", "kind: ConfigMap\n", "kind: ConfigMap\n  bad: indent\n", "not YAML"),
        ("rollout.yaml", "replicas: {{", "replicas: {", "unmatched '}}'"),
    ],
)
def test_static_checks_catch_broken_templates(tmp_path: Path, file: str, old: str, new: str, expected: str) -> None:
    chart = tmp_path / "rollwave"
    shutil.copytree(CHART, chart)
    path = chart / "templates" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    errors = lint_chart(chart)
    assert any(expected in e and e.startswith(f"templates/{file}") for e in errors), errors


def _go_dict_keys(expr: str) -> dict[str, Any]:
    """Keys of a nested ``dict "k" v "k2" (dict ...)`` Go-template expression."""
    tokens = re.findall(r'"[^"]*"|\(|\)|[^\s()"]+', expr)

    def group(i: int) -> tuple[list[Any], int]:
        items: list[Any] = []
        while i < len(tokens) and tokens[i] != ")":
            if tokens[i] == "(":
                sub, i = group(i + 1)
                items.append(sub)
            else:
                items.append(tokens[i])
            i += 1
        return items, i

    def keys(items: list[Any]) -> dict[str, Any]:
        assert items[0] == "dict", items
        pairs = items[1:]
        return {pairs[k].strip('"'): keys(pairs[k + 1]) if isinstance(pairs[k + 1], list)
                and pairs[k + 1][0] == "dict" else None for k in range(0, len(pairs), 2)}

    return keys(group(0)[0])


def test_chart_sets_only_run_config_keys_that_exist() -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    expr = re.search(r"\$base := (dict.*?)-?\}\}", helpers, re.S).group(1)
    tree = _go_dict_keys(expr)
    keys = [f"{section}.{key}" for section, sub in tree.items() for key in sub]
    tls = re.search(r"\$tls := (dict.*?)-?\}\}", helpers, re.S).group(1)  # merged into checkpoint when enabled
    keys += [f"checkpoint.{key}" for key in _go_dict_keys(tls)]
    assert len(keys) >= 10
    args = []
    for path in (CHART / "templates").glob("*.yaml"):
        args += re.findall(r'(?:^\s*- |")([a-z_]+\.[a-z_]+)=', path.read_text(), re.M)
    assert "rollout.server_id" in args
    assert not [a for a in args if a in SECRETS], "secrets reach containers as environment variables only"
    assert [k for k in keys + args if not _config_key_exists(k)] == []
