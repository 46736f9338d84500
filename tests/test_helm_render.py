"""The Helm chart rendered by Helm's own engine (the Go SDK, through the ``helm-python-sdk`` wheel).

No cluster is contacted (``lookup`` returns nothing), so what is checked is the rendered manifests:
they parse, pods only mount volumes they define and probe ports they declare, the knobs of
values.yaml (replicas, GPUs, Redis URL, secrets, engine backend, ServiceMonitors) land where
they should, every rollwave container's command line loads with the rendered run config through
core.config, and the security settings hold: each container gets only its own secret and none on a
command line, engines stay on loopback, every pod runs unprivileged with a read-only root, and the
NetworkPolicies let only the trainer reach the receivers. Kubernetes' own API validation and
scheduling are not exercised.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import pytest
import yaml
from cryptography import x509
from tls_handshake import handshakes

from core.config import TRAINER_CERT_NAME, Config, load_config, require_secret

CHART = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "rollwave"
PROMETHEUS = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "prometheus.yml"
ENV = {"POD_NAME": "rw-rollwave-rollout-0", "POD_IP": "10.1.2.3", "POD_INDEX": "0"}
SECRETS = {"ROLLWAVE_API_TOKEN": "a" * 48, "ROLLWAVE_CHECKPOINT_TOKEN": "c" * 48}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values or {})
        manifests = chart.render(values or {}, name="rw", namespace="ml")
    docs = []
    for path, text in manifests.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def find(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    return doc


def containers(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def secret_env(container: dict[str, Any]) -> dict[str, str]:
    """The secrets a container gets from the chart's Secret: variable -> key."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def run_config(
    docs: list[dict[str, Any]], tmp_path: Path, argv: list[str], env: dict[str, str] | None = None
) -> Config:
    """The config a container's ``-c /config/run.yaml key=value ...`` command line would load, with ``env``."""
    path = tmp_path / "run.yaml"
    path.write_text(find(docs, "ConfigMap", "-config")["data"]["run.yaml"])
    start = argv.index("/config/run.yaml") + 1
    overrides = [re.sub(r"\$\((\w+)\)", lambda m: ENV[m.group(1)], a) for a in argv[start:] if "=" in a
                 and not a.startswith("-")]
    return load_config(path, overrides, env=env or {})


def test_helm_lint_finds_no_problems() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_values_render_a_complete_cpu_stack(tmp_path: Path) -> None:
    docs = render()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [
        ("ConfigMap", "rw-rollwave-config"),
        ("Deployment", "rw-rollwave-api"),
        ("NetworkPolicy", "rw-rollwave-api"),
        ("NetworkPolicy", "rw-rollwave-redis"),
        ("NetworkPolicy", "rw-rollwave-rollout"),
        ("NetworkPolicy", "rw-rollwave-trainer"),
        ("Secret", "rw-rollwave-checkpoint-tls"),
        ("Secret", "rw-rollwave-secrets"),
        ("Service", "rw-rollwave-api"),
        ("Service", "rw-rollwave-redis"),
        ("Service", "rw-rollwave-rollout"),
        ("Service", "rw-rollwave-trainer"),
        ("StatefulSet", "rw-rollwave-redis"),
        ("StatefulSet", "rw-rollwave-rollout"),
        ("StatefulSet", "rw-rollwave-trainer"),
    ]
    redis = containers(find(docs, "StatefulSet", "-redis"))["redis"]
    assert redis["args"][:2] == ["--appendonly", "yes"]
    assert "user default off" in redis["command"][2] and "--aclfile" in redis["command"][2]
    assert secret_env(redis) == {"ROLLWAVE_REDIS_PASSWORD": "redis-password"}
    rollout = find(docs, "StatefulSet", "-rollout")
    assert rollout["spec"]["replicas"] == 2 and set(containers(rollout)) == {"model-init", "rollout-server"}
    for name, container in [("rollout-server", containers(rollout)["rollout-server"]),
                            ("trainer", containers(find(docs, "StatefulSet", "-trainer"))["trainer"])]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["OMP_WAIT_POLICY"] == "PASSIVE", name  # placement is empty: idle OpenMP threads sleep
    for doc in docs:
        for container in containers(doc).values() if doc["kind"] in ("Deployment", "StatefulSet") else []:
            assert "nvidia.com/gpu" not in container.get("resources", {}).get("limits", {}), container["name"]
    secret = find(docs, "Secret", "-secrets")
    tokens = [base64.b64decode(secret["data"][k]) for k in ("api-token", "checkpoint-token", "redis-password")]
    assert [len(t) for t in tokens] == [48] * 3 and len(set(tokens)) == 3


@pytest.mark.parametrize("inspectable", [False, True])
def test_inspectable_leaves_the_rollwave_processes_dumpable(inspectable: bool) -> None:
    """``inspectable: true`` (debugging in the pods: py-spy, gdb) gives the API, the rollout servers and the trainer
    ``ROLLWAVE_INSPECTABLE=1``; by default none has it, so each makes itself not dumpable (core.process)."""
    docs = render({"inspectable": True} if inspectable else {})
    pods = {"api": find(docs, "Deployment", "-api"), "rollout-server": find(docs, "StatefulSet", "-rollout"),
            "trainer": find(docs, "StatefulSet", "-trainer")}
    found = {name: {e["name"]: e.get("value") for e in containers(pod)[name]["env"]}.get("ROLLWAVE_INSPECTABLE")
             for name, pod in pods.items()}
    assert found == dict.fromkeys(("api", "rollout-server", "trainer"), "1" if inspectable else None)


def test_every_rollwave_command_loads_with_the_rendered_config(tmp_path: Path) -> None:
    for values in ({}, {"engine": {"backend": "sglang"}, "trainer": {"gpusPerNode": 2, "ranksPerNode": 2}}):
        docs = render(values)
        seen = set()
        for doc in docs:
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for container in containers(doc).values():
                argv = container.get("command", []) + container.get("args", [])
                if "/config/run.yaml" not in argv:
                    continue
                module = argv[argv.index("-m") + 1]
                own = "ROLLWAVE_API_TOKEN" if module == "services.api" else "ROLLWAVE_CHECKPOINT_TOKEN"
                assert secret_env(container) == {own: own.removeprefix("ROLLWAVE_").lower().replace("_", "-"),
                                                 "ROLLWAVE_REDIS_PASSWORD": "redis-password"}
                assert not [a for a in argv if "token" in a.lower() or "$(ROLLWAVE" in a], argv
                cfg = run_config(docs, tmp_path, argv, {own: SECRETS[own], "ROLLWAVE_REDIS_PASSWORD": "r" * 40})
                assert cfg.redis.url == "redis://rw-rollwave-redis:6379/0" and cfg.run.dir == Path("/runs")
                assert cfg.redis.username == "rollwave" and cfg.redis.password.get_secret_value() == "r" * 40
                required = "api.token" if module == "services.api" else "checkpoint.token"
                assert require_secret(cfg, required) == SECRETS[own], module
                seen.add(module)
        assert seen == {"services.api", "rollout_server", "trainer"}


def test_pods_mount_defined_volumes_and_probe_declared_ports() -> None:
    for values in ({}, {"engine": {"backend": "sglang"}, "model": {"existingClaim": "models"}}):
        for doc in render(values):
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            volumes = {v["name"] for v in spec.get("volumes", [])}
            volumes |= {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
            for container in containers(doc).values():
                mounts = {m["name"] for m in container.get("volumeMounts", [])}
                assert mounts <= volumes, (doc["metadata"]["name"], container["name"], mounts - volumes)
                ports = {p["name"] for p in container.get("ports", [])}
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    port = container.get(probe, {}).get("httpGet", {}).get("port")
                    assert port is None or port in ports, (container["name"], probe, port)
                    if probe in container:  # SGLang's /health answers after 1 s; Kubernetes' default is 1 s
                        assert container[probe].get("timeoutSeconds", 1) >= 3, (container["name"], probe)


def test_sglang_startup_budget_fits_a_big_model() -> None:
    for budget in (None, 7200):
        values = {"engine": {"backend": "sglang", **({"sglang": {"startupSeconds": budget}} if budget else {})}}
        rollout = find(render(values), "StatefulSet", "-rollout")
        pods = containers(rollout)
        probe = pods["sglang"]["startupProbe"]
        seconds = budget or 3600
        assert probe["periodSeconds"] * probe["failureThreshold"] == seconds
        assert f"engine.ready_timeout_s={seconds}" in pods["rollout-server"]["args"]


def test_sglang_backend_puts_an_engine_with_gpus_beside_each_rollout_server(tmp_path: Path) -> None:
    docs = render({"engine": {"backend": "sglang", "sglang": {"gpus": 2, "args": ["--tp-size=2"]}},
                   "rollout": {"replicas": 5}})
    rollout = find(docs, "StatefulSet", "-rollout")
    assert rollout["spec"]["replicas"] == 5
    pod = containers(rollout)
    sglang, server = pod["sglang"], pod["rollout-server"]
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert sglang["image"].startswith("lmsysorg/sglang:") and "--tp-size=2" in sglang["args"]
    cfg = run_config(docs, tmp_path, server["command"] + server["args"])
    assert cfg.engine.backend == "sglang" and cfg.engine.urls == ["http://127.0.0.1:30000"]
    assert cfg.rollout.server_id == ENV["POD_NAME"] and cfg.rollout.grpc_host == ENV["POD_IP"]
    stage = str(cfg.checkpoint.stage_dir)
    for container in (sglang, server):
        assert stage in {m["mountPath"] for m in container["volumeMounts"]}, container["name"]
    assert "--port=30000" in sglang["args"] and "--enable-metrics" in sglang["args"]


def test_trainer_pool_spans_nodes_with_gpus(tmp_path: Path) -> None:
    shared = {"existingClaim": "runs"}  # a checkpoint's ranks write one directory
    docs = render({"trainer": {"nodes": 3, "ranksPerNode": 8, "gpusPerNode": 8, "persistence": shared}})
    trainer = find(docs, "StatefulSet", "-trainer")
    assert trainer["spec"]["replicas"] == 3
    container = containers(trainer)["trainer"]
    assert container["image"] == "rollwave-gpu:0.1.0"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    args = container["args"]
    assert {"--nnodes=3", "--nproc-per-node=8", "--node-rank=$(POD_INDEX)"} <= set(args)
    assert "--master-addr=rw-rollwave-trainer-0.rw-rollwave-trainer" in args
    assert run_config(docs, tmp_path, args).trainer.device == "cuda"


def test_external_redis_and_existing_secret(tmp_path: Path) -> None:
    docs = render({"redis": {"url": "rediss://redis.example:6380/2"},
                   "secrets": {"existingSecret": "my-secrets", "apiTokenKey": "api", "checkpointTokenKey": "ckpt"}})
    assert not [d for d in docs if "redis" in d["metadata"]["name"] or d["metadata"]["name"] == "rw-rollwave-secrets"]
    api = containers(find(docs, "Deployment", "-api"))["api"]
    env = {e["name"]: e for e in api["env"]}
    assert env["REDIS_URL"]["value"] == "rediss://redis.example:6380/2"
    assert env["ROLLWAVE_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-secrets", "key": "api"}
    trainer = containers(find(docs, "StatefulSet", "-trainer"))["trainer"]
    assert secret_env(trainer) == {"ROLLWAVE_CHECKPOINT_TOKEN": "ckpt", "ROLLWAVE_REDIS_PASSWORD": "redis-password"}
    no_login = render({"redis": {"url": "redis://redis.example:6379/0", "auth": {"enabled": False, "username": ""}}})
    trainer = containers(find(no_login, "StatefulSet", "-trainer"))["trainer"]
    assert secret_env(trainer) == {"ROLLWAVE_CHECKPOINT_TOKEN": "checkpoint-token"}
    assert run_config(docs, tmp_path, api["command"] + api["args"]).redis.url == "rediss://redis.example:6380/2"


def test_run_config_values_merge_over_the_charts(tmp_path: Path) -> None:
    docs = render({"runConfig": {"trainer": {"lr": 1.0e-5}, "rollout": {"n_samples": 16}}})
    cfg = run_config(docs, tmp_path, ["-c", "/config/run.yaml"])
    assert cfg.trainer.lr == 1.0e-5 and cfg.rollout.n_samples == 16
    assert cfg.rollout.metrics_port == 9100 and cfg.trainer.metrics_port == 9200
    assert cfg.rollout.metrics_host == cfg.trainer.metrics_host == "0.0.0.0"


def test_service_monitors_use_the_prometheus_job_names() -> None:
    docs = render({"monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}}})
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    jobs = {j["job_name"] for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]} - {"prometheus"}
    names = set()
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kps"
        [endpoint] = monitor["spec"]["endpoints"]
        *keep, relabel = endpoint["relabelings"]
        names.add(relabel["replacement"])
        if relabel["replacement"] == "rollwave-trainer":  # only rank 0 serves metrics: the pool's other pods are no
            [rule] = keep                                   # targets, rather than down ones
            assert rule["action"] == "keep" and rule["sourceLabels"] == ["__meta_kubernetes_pod_name"]
            assert re.fullmatch(rule["regex"], "rw-rollwave-trainer-0")
            assert not re.fullmatch(rule["regex"], "rw-rollwave-trainer-1")
            assert not re.fullmatch(rule["regex"], "rw-rollwave-trainer-10")
        else:
            assert keep == []
        selector = monitor["spec"]["selector"]["matchLabels"]
        [service] = [d for d in docs if d["kind"] == "Service" and selector.items() <= d["metadata"]["labels"].items()]
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert names == jobs


def test_schema_violations_are_rejected_by_helm() -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match="engine/backend"):
        chart.validate_schema({"engine": {"backend": "vllm"}})


WORKLOADS = ("Deployment", "StatefulSet")


def test_pods_run_unprivileged_on_a_read_only_root() -> None:
    for values in ({}, {"engine": {"backend": "sglang"}, "trainer": {"gpusPerNode": 2}}):
        for doc in render(values):
            if doc["kind"] not in WORKLOADS:
                continue
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
            mounts_tmp = doc["metadata"]["name"].endswith("-redis") or any(
                v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])
            assert mounts_tmp, doc["metadata"]["name"]
            for container in containers(doc).values():
                ctx = container["securityContext"]
                assert ctx == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                               "capabilities": {"drop": ["ALL"]}}, container["name"]


def test_engines_listen_on_loopback_and_have_no_port_or_service(tmp_path: Path) -> None:
    for values in ({}, {"engine": {"backend": "sglang"}}):
        docs = render(values)
        rollout = find(docs, "StatefulSet", "-rollout")
        pod = containers(rollout)
        server = pod["rollout-server"]
        cfg = run_config(docs, tmp_path, server["command"] + server["args"])
        assert cfg.engine.host == "127.0.0.1" and all("127.0.0.1" in url for url in cfg.engine.urls)
        ports = {p["name"]: p["containerPort"] for p in server["ports"]}
        assert (cfg.rollout.grpc_port, cfg.rollout.stage_port) == (ports["grpc"], ports["stage"]) == (50051, 50052)
        for container in pod.values():
            assert {p["name"] for p in container.get("ports", [])} <= {"grpc", "stage", "metrics"}, container["name"]
        service = find(docs, "Service", "-rollout")
        assert {p["name"] for p in service["spec"]["ports"]} == {"grpc", "stage", "metrics"}
        if "sglang" in pod:
            assert "--host=127.0.0.1" in pod["sglang"]["args"] and not [a for a in pod["sglang"]["args"]
                                                                       if a.startswith("--host=0")]
            assert "exec" in pod["sglang"]["startupProbe"] and "exec" in pod["sglang"]["readinessProbe"]


def test_the_rendezvous_port_stays_internal() -> None:
    docs = render({"trainer": {"nodes": 2, "persistence": {"existingClaim": "runs"}}})
    trainer = containers(find(docs, "StatefulSet", "-trainer"))["trainer"]
    assert "rendezvous" in {p["name"] for p in trainer["ports"]}
    services = [d for d in docs if d["kind"] == "Service"]
    assert not [p for d in services for p in d["spec"]["ports"] if p.get("targetPort") == "rendezvous"
                or p["port"] == 29500]
    policy = find(docs, "NetworkPolicy", "-trainer")["spec"]
    [peers, metrics] = policy["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "rollwave", "app.kubernetes.io/instance": "rw",
        "app.kubernetes.io/component": "trainer"}}}]}
    assert metrics == {"ports": [{"port": "metrics"}]}


def test_only_the_trainer_reaches_the_checkpoint_receivers() -> None:
    scraper = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    docs = render({"networkPolicy": {"metricsFrom": [scraper]}})
    policy = find(docs, "NetworkPolicy", "-rollout")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "rollout"
    assert policy["policyTypes"] == ["Ingress"]
    [grpc, metrics] = policy["ingress"]
    assert grpc["ports"] == [{"port": "grpc"}, {"port": "stage"}]
    [peer] = grpc["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    assert metrics == {"ports": [{"port": "metrics"}], "from": [scraper]}
    rollout = containers(find(docs, "StatefulSet", "-rollout"))["rollout-server"]
    assert {p["name"] for p in rollout["ports"]} == {"grpc", "stage", "metrics"}  # every port the pod has is covered
    redis = find(docs, "NetworkPolicy", "-redis")["spec"]["ingress"][0]
    assert redis["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["api", "rollout", "trainer"]
    assert not [d for d in render({"networkPolicy": {"enabled": False}}) if d["kind"] == "NetworkPolicy"]


def test_the_api_answers_its_service_names(tmp_path: Path) -> None:
    docs = render()
    api = containers(find(docs, "Deployment", "-api"))["api"]
    cfg = run_config(docs, tmp_path, api["command"] + api["args"])
    assert {"127.0.0.1", "localhost", "rw-rollwave-api", "rw-rollwave-api.ml.svc.cluster.local"} <= set(
        cfg.api.allowed_hosts)
    assert cfg.api.data_root == Path("/data")
    assert "data" not in {v["name"] for v in find(docs, "Deployment", "-api")["spec"]["template"]["spec"]["volumes"]}
    with_data = find(render({"api": {"dataClaim": "tasks"}}), "Deployment", "-api")["spec"]["template"]["spec"]
    [volume] = [v for v in with_data["volumes"] if v["name"] == "data"]
    assert volume["persistentVolumeClaim"] == {"claimName": "tasks", "readOnly": True}


def test_run_config_hosts_add_to_the_service_names(tmp_path: Path) -> None:
    """An ingress host in ``runConfig.api.allowed_hosts`` joins the chart's names (a list would replace them:
    port-forward and in-cluster clients would get 400), once each."""
    docs = render({"runConfig": {"api": {"allowed_hosts": ["rl.example.com", "localhost"]}}})
    api = containers(find(docs, "Deployment", "-api"))["api"]
    hosts = run_config(docs, tmp_path, api["command"] + api["args"]).api.allowed_hosts
    assert {"rl.example.com", "127.0.0.1", "localhost", "rw-rollwave-api.ml.svc"} <= set(hosts)
    assert len(hosts) == len(set(hosts))
    docs = render({"runConfig": {"api": {"allowed_hosts": None}}})
    assert "rw-rollwave-api.ml.svc" in run_config(docs, tmp_path, api["command"] + api["args"]).api.allowed_hosts


def tls_volume(doc: dict[str, Any], container: str) -> dict[str, Any] | None:
    """The checkpoint-tls volume a workload's container mounts at /tls (None: none)."""
    mounts = [m for m in containers(doc)[container].get("volumeMounts", []) if m["name"] == "checkpoint-tls"]
    volumes = [v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "checkpoint-tls"]
    if not mounts:
        assert not volumes
        return None
    assert mounts == [{"name": "checkpoint-tls", "mountPath": "/tls", "readOnly": True}]
    [volume] = volumes
    return volume["secret"]


def test_the_checkpoint_plane_is_mutual_tls_with_the_charts_certificates(tmp_path: Path) -> None:
    """By default the chart makes a CA and two certificates it signs: rollout servers serve the receiver's
    (naming checkpointTLS.serverName) and the trainer presents its own. With those files as the pods get them, a
    pusher configured as the trainer is completes a mutual TLS handshake with a receiver configured as a rollout
    server is, at an IP address (as pods advertise); checking the dialled IP instead, or presenting no
    certificate, fails. sprig's certificates allow both uses, so the receiver's key completes a handshake as a
    client too: the receivers' ``checkpoint.tls_client_name`` names the trainer's certificate alone
    (``checkpointTLS.clientName``, here not the default)."""
    docs = render({"checkpointTLS": {"enabled": True, "existingSecret": "", "serverName": "receivers.rw",
                                     "clientName": "pusher.rw"}})
    data = {k: base64.b64decode(v) for k, v in find(docs, "Secret", "-checkpoint-tls")["data"].items()}
    configs = {}
    for kind, suffix, container, side in (("StatefulSet", "-rollout", "rollout-server", "receiver"),
                                          ("StatefulSet", "-trainer", "trainer", "trainer")):
        doc = find(docs, kind, suffix)
        assert tls_volume(doc, container) == {
            "secretName": "rw-rollwave-checkpoint-tls", "defaultMode": 0o440,
            "items": [{"key": "ca.crt", "path": "ca.crt"}, {"key": f"{side}.crt", "path": "tls.crt"},
                      {"key": f"{side}.key", "path": "tls.key"}]}
        pod_dir = tmp_path / side  # the files as the pod sees them under /tls
        pod_dir.mkdir()
        for item in tls_volume(doc, container)["items"]:
            (pod_dir / item["path"]).write_bytes(data[item["key"]])
        argv = containers(doc)[container]["command"] + containers(doc)[container]["args"]
        cfg = run_config(docs, tmp_path, argv).checkpoint
        assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (Path("/tls/tls.crt"), Path("/tls/tls.key"),
                                                           Path("/tls/ca.crt"))
        assert cfg.tls_server_name == "receivers.rw"
        configs[side] = cfg.model_copy(update={"tls_cert": pod_dir / "tls.crt", "tls_key": pod_dir / "tls.key",
                                               "tls_ca": pod_dir / "ca.crt"})
    trainer = configs["trainer"]
    assert handshakes(configs["receiver"], trainer)
    assert not handshakes(configs["receiver"], trainer.model_copy(update={"tls_server_name": None}))
    assert not handshakes(configs["receiver"], trainer, grpc.ssl_channel_credentials(data["ca.crt"]))
    receiver = configs["receiver"]
    assert handshakes(receiver, trainer.model_copy(update={"tls_cert": receiver.tls_cert, "tls_key": receiver.tls_key}))
    names = {side: x509.load_pem_x509_certificate(data[f"{side}.crt"]).extensions
             .get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
             for side in ("receiver", "trainer")}
    assert receiver.tls_client_name == "pusher.rw"
    assert names == {"receiver": ["receivers.rw"], "trainer": ["pusher.rw"]}


def test_checkpoint_tls_can_be_off_or_come_from_an_existing_secret(tmp_path: Path) -> None:
    """``checkpointTLS.enabled: false``: no Secret, no mount, a plaintext plane (token and proof only);
    ``existingSecret``: the chart generates none and the pods mount the one named."""
    off = render({"checkpointTLS": {"enabled": False, "existingSecret": "", "serverName": "x"}})
    assert not [d for d in off if d["metadata"]["name"].endswith("-checkpoint-tls")]
    for suffix, container in (("-rollout", "rollout-server"), ("-trainer", "trainer")):
        doc = find(off, "StatefulSet", suffix)
        assert tls_volume(doc, container) is None
        argv = containers(doc)[container]["command"] + containers(doc)[container]["args"]
        assert run_config(off, tmp_path, argv).checkpoint.tls_cert is None
    mine = render({"checkpointTLS": {"enabled": True, "existingSecret": "my-pki", "serverName": "x"}})
    assert not [d for d in mine if d["metadata"]["name"].endswith("-checkpoint-tls")]
    for suffix, container in (("-rollout", "rollout-server"), ("-trainer", "trainer")):
        doc = find(mine, "StatefulSet", suffix)
        assert tls_volume(doc, container)["secretName"] == "my-pki"
        argv = containers(doc)[container]["command"] + containers(doc)[container]["args"]
        assert run_config(mine, tmp_path, argv).checkpoint.tls_client_name == TRAINER_CERT_NAME  # the default
