"""Deployment defects an operator would hit, each checked on what the chart renders or the files hold:
Prometheus reaching every ServiceMonitor target through the NetworkPolicies, secrets kept out of the run
config's ConfigMap, the rollout server's memory limit holding the tmpfs staging area it writes, and the
images declaring the ports their compose services serve."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from test_helm_render import containers, find, render

from core.config import SECRETS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
INGRESS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}
COMPONENT = "app.kubernetes.io/component"


def admits(rule: dict[str, Any], port: str, peer: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy ingress rule lets ``peer`` open a connection to the named ``port``."""
    ports = rule.get("ports")
    return (ports is None or {"port": port} in ports) and ("from" not in rule or peer in rule["from"])


def test_prometheus_reaches_every_service_monitor_target_when_the_api_is_restricted() -> None:
    """With ``apiFrom`` limited to the ingress controller and ``metricsFrom`` to Prometheus, each ServiceMonitor's
    port (the API's /metrics is on its http port) still admits Prometheus, and the API admits no one else."""
    docs = render({"networkPolicy": {"metricsFrom": [SCRAPER], "apiFrom": [INGRESS]},
                   "monitoring": {"serviceMonitor": {"enabled": True}}})
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert len(monitors) == 4
    for monitor in monitors:
        component = monitor["spec"]["selector"]["matchLabels"][COMPONENT]
        [endpoint] = monitor["spec"]["endpoints"]
        rules = [rule for p in policies if p["spec"]["podSelector"]["matchLabels"].get(COMPONENT) == component
                 for rule in p["spec"]["ingress"]]
        assert rules and any(admits(rule, endpoint["port"], SCRAPER) for rule in rules), monitor["metadata"]["name"]
    api = find(docs, "NetworkPolicy", "-api")["spec"]["ingress"]
    assert all(rule.get("from") and all(peer in (INGRESS, SCRAPER) for peer in rule["from"]) for rule in api)
    assert any(admits(rule, "http", INGRESS) for rule in api)


@pytest.mark.parametrize("dotted", sorted(SECRETS))
def test_a_secret_in_run_config_is_refused_not_put_in_the_config_map(dotted: str) -> None:
    """``runConfig`` lands in a ConfigMap: a secret there would be readable by whoever reads ConfigMaps."""
    section, field = dotted.split(".")
    with pytest.raises(helm.HelmRenderError, match=rf"runConfig\.{dotted}: .*Secret"):
        render({"runConfig": {section: {field: "s" * 40}}})
    file_given = render({"runConfig": {section: {f"{field}_file": "/secrets/x"}}})  # a path is no secret
    assert f"{field}_file: /secrets/x" in find(file_given, "ConfigMap", "-config")["data"]["run.yaml"]


@pytest.mark.parametrize("dotted, value, owner", [
    ("rollout.grpc_port", 6000, "rollout.grpcPort"), ("rollout.stage_port", 6001, "rollout.stagePort"),
    ("rollout.metrics_port", 9300, "rollout.metricsPort"), ("trainer.metrics_port", 9300, "trainer.metricsPort"),
    ("rollout.metrics_host", "127.0.0.1", "Prometheus"), ("trainer.metrics_host", "127.0.0.1", "Prometheus"),
    ("model.path", "/models/other", "model.path"), ("engine.port", 31000, "engine.port"),
    ("run.dir", "/elsewhere", "trainer's volume"), ("checkpoint.stage_dir", "/tmp/stage", "rollout.stageSize"),
    ("checkpoint.tls_server_name", "other", "checkpointTLS.serverName"),
    ("redis.url", "redis://other:6379/0", "redis.url"), ("redis.username", "other", "redis.auth.username"),
    ("checkpoint.tls_cert", "/x.crt", "checkpointTLS"), ("checkpoint.tls_key", "/x.key", "checkpointTLS"),
    ("checkpoint.tls_ca", "/ca.crt", "checkpointTLS"), ("trainer.device", "cpu", "trainer.gpusPerNode"),
    ("api.data_root", "/elsewhere", "api.dataClaim"), ("api.host", "127.0.0.1", "0.0.0.0"),
    ("api.port", 9000, "api.port"), ("engine.backend", "sglang", "engine.backend"),
    ("rollout.server_id", "x", "pod's name"), ("rollout.grpc_host", "10.0.0.1", "pod's IP"),
])
def test_run_config_cannot_move_what_the_chart_wires_from_its_values(dotted: str, value: Any, owner: str) -> None:
    """A key the chart derives from a value (a port its Service and NetworkPolicy name, a path a volume is mounted
    at, a name its certificates carry) set in ``runConfig`` would leave the process and the manifests apart
    (Prometheus scraping a port nothing serves, checkpoints on the read-only root): refused, naming the value."""
    section, field = dotted.split(".")
    with pytest.raises(helm.HelmRenderError, match=rf"runConfig\.{dotted}: .*{re.escape(owner)}"):
        render({"runConfig": {section: {field: value}}})


UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity_bytes(value: str | int) -> int:
    number, unit = re.fullmatch(r"(\d+)([kMGT]i?|Ki)?", str(value)).groups()
    return int(number) * UNITS[unit or ""]


@pytest.mark.parametrize("backend", ["embedded", "sglang"])
def test_the_rollout_server_memory_limit_holds_its_staging_area(backend: str) -> None:
    """The staging area is a memory-backed emptyDir that the rollout-server container writes: its pages count
    against that container's memory limit, so a limit below ``rollout.stageSize`` is OOM-killed at a big push."""
    docs = render({"engine": {"backend": backend}})
    rollout = find(docs, "StatefulSet", "-rollout")
    [stage] = [v for v in rollout["spec"]["template"]["spec"]["volumes"] if v["name"] == "stage"]
    limit = containers(rollout)["rollout-server"]["resources"]["limits"]["memory"]
    assert quantity_bytes(limit) > quantity_bytes(stage["emptyDir"]["sizeLimit"])


def test_a_memory_limit_below_the_staging_area_is_refused() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"rollout\.resources\.limits\.memory \(40Gi\).*rollout\.stageSize"
                                                   r" \(64Gi\)"):
        render({"rollout": {"stageSize": "64Gi", "resources": {"requests": {}, "limits": {"memory": "40Gi"}}}})
    small = render({"rollout": {"stageSize": "512Mi", "resources": {"requests": {}, "limits": {"memory": "1Gi"}}}})
    assert containers(find(small, "StatefulSet", "-rollout"))["rollout-server"]["resources"]["limits"] == {
        "memory": "1Gi"}
    unlimited = render({"rollout": {"resources": {"requests": {}, "limits": {"memory": None}}}})
    assert containers(find(unlimited, "StatefulSet", "-rollout"))["rollout-server"]["resources"]["limits"] == {}


@pytest.mark.parametrize("dockerfile, image", [("Dockerfile", "ROLLWAVE_IMAGE"),
                                               ("Dockerfile.gpu", "ROLLWAVE_GPU_IMAGE")])
def test_images_expose_the_ports_their_compose_services_serve(dockerfile: str, image: str) -> None:
    text = (DEPLOY / dockerfile).read_text()
    exposed = {p for line in re.findall(r"^EXPOSE (.*)$", text, re.M) for p in line.split()}
    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    served = {str(p) for svc in services.values() if f"${{{image}:" in svc.get("image", "")
              for p in svc.get("expose", [])}
    assert served and served <= exposed, served - exposed
