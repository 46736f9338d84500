"""Config values a run or the chart took and failed on far from where they were given, now refused where they are
given: AdamW betas torch refuses (or, on a resume, turns into NaN), infinite or NaN numbers,
a secret's newline from a Kubernetes Secret, api.allowed_hosts entries no Host header matches, an override under a
null section, cross-section checks that named no line; and Helm values that rendered pods which cannot start (a
model path nothing holds, a run name the components refuse, a multi-node trainer without shared storage, more ranks
than GPUs), runConfig keys a command line overrode, a shared secret key, or SGLang flags that move it off loopback."""

from __future__ import annotations

import re
from pathlib import Path

import helm_python as helm
import pytest
import torch
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import PlainTextResponse
from starlette.testclient import TestClient
from test_helm_render import containers, find, render

from core.config import ConfigError, dump_config, load_config


def test_adam_betas_outside_torchs_bounds_are_refused_naming_the_file_line_and_key(tmp_path: Path) -> None:
    """torch refuses a β outside [0, 1) when the optimizer is built, the trainer's start; a resume sets the
    config's betas on the restored optimizer, where torch checks nothing and β2 = 1 makes every update NaN."""
    param = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        torch.optim.AdamW([param], betas=(0.9, 1.0))
    resumed = torch.optim.AdamW([param])
    resumed.param_groups[0].update(betas=(0.9, 1.0))
    param.grad = torch.ones(2)
    resumed.step()
    assert param.isnan().all()

    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 1.0e-5\n  betas:\n    - 0.9\n    - 1.0\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}:5: trainer\.betas\.1: Input should be less than 1"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"trainer\.betas\.0: Input should be greater than or equal to 0"):
        load_config(None, ["trainer.betas=[-0.1,0.9]"], env={})
    assert load_config(None, ["trainer.betas=[0.0,0.95]"], env={}).trainer.betas == (0.0, 0.95)


@pytest.mark.parametrize("dotted", ["trainer.lr", "trainer.kl_coef", "trainer.overlong.penalty_factor",
                                    "rollout.temperature", "redis.timeout_s", "checkpoint.commit_timeout_s"])
@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_numbers_that_are_not_finite_are_refused_naming_the_key(dotted: str, value: str) -> None:
    """An infinite learning rate or coefficient turns every weight or advantage NaN; an infinite timeout overflows
    the socket's timeout at the first connection (``redis.timeout_s``), an error that names no key."""
    with pytest.raises(ConfigError, match=rf"{re.escape(dotted)}: Input should be a finite number"):
        load_config(None, [f"{dotted}={value}"], env={})


@pytest.mark.parametrize("model, message", [
    ({"path": "/models/Qwen2.5-7B"}, r"model\.path: /models/Qwen2\.5-7B is not in the pods' emptyDir.*existingClaim"),
    ({"initTiny": False}, r"model\.existingClaim: empty, with model\.initTiny false, leaves /models an empty"),
    ({"existingClaim": "models", "path": "/data/qwen"}, r"model\.path: /data/qwen is not under /models"),
])
def test_a_model_the_pods_would_not_find_is_refused(model: dict[str, object], message: str) -> None:
    """Every rollwave pod mounts the claim, or an emptyDir holding only the tiny model, at /models: a model.path
    elsewhere would make each component exit at start naming a path the values never showed."""
    with pytest.raises(helm.HelmRenderError, match=message):
        render({"model": model})


def test_a_model_on_a_claim_reaches_every_pod() -> None:
    assert "path: /models\n" in find(render({"model": {"existingClaim": "qwen", "path": "/models"}}), "ConfigMap",
                                     "-config")["data"]["run.yaml"]  # the claim's root is the model directory
    docs = render({"model": {"existingClaim": "models", "path": "/models/Qwen2.5-7B"}, "engine": {"backend": "sglang"}})
    assert "path: /models/Qwen2.5-7B" in find(docs, "ConfigMap", "-config")["data"]["run.yaml"]
    rollout = find(docs, "StatefulSet", "-rollout")
    assert "--model-path=/models/Qwen2.5-7B" in containers(rollout)["sglang"]["args"]
    [models] = [v for v in rollout["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"]["claimName"] == "models"


def test_a_trainer_of_several_pods_writes_its_checkpoints_to_one_shared_claim() -> None:
    """Each rank writes its shards of a checkpoint into one directory and reads a share of all of them back
    (trainer/checkpoint.py): a volume per pod (the StatefulSet's claim template) failed the first checkpoint."""
    with pytest.raises(helm.HelmRenderError, match=r"trainer\.nodes \(2\) needs trainer\.persistence\.existingClaim"):
        render({"trainer": {"nodes": 2}})
    one = find(render({}), "StatefulSet", "-trainer")
    assert [t["metadata"]["name"] for t in one["spec"]["volumeClaimTemplates"]] == ["runs"]
    shared = find(render({"trainer": {"nodes": 2, "persistence": {"existingClaim": "rw-runs"}}}), "StatefulSet",
                  "-trainer")
    assert "volumeClaimTemplates" not in shared["spec"]
    [runs] = [v for v in shared["spec"]["template"]["spec"]["volumes"] if v["name"] == "runs"]
    assert runs == {"name": "runs", "persistentVolumeClaim": {"claimName": "rw-runs"}}
    assert {"name": "runs", "mountPath": "/runs"} in containers(shared)["trainer"]["volumeMounts"]


def test_a_trainer_pod_has_a_gpu_for_each_of_its_ranks() -> None:
    """A rank trains on ``cuda:<LOCAL_RANK>`` (trainer/parallel.py): ranks past the pod's GPUs name a device it
    does not have. CPU pods (gpusPerNode 0) run any number of gloo ranks."""
    with pytest.raises(helm.HelmRenderError, match=r"trainer\.ranksPerNode \(8\) exceeds trainer\.gpusPerNode \(4\)"):
        render({"trainer": {"ranksPerNode": 8, "gpusPerNode": 4}})
    for ranks, gpus in ((4, 4), (2, 0)):
        trainer = containers(find(render({"trainer": {"ranksPerNode": ranks, "gpusPerNode": gpus}}), "StatefulSet",
                                  "-trainer"))["trainer"]
        assert f"--nproc-per-node={ranks}" in trainer["args"]


@pytest.mark.parametrize("keys", [{"apiTokenKey": "token", "checkpointTokenKey": "token"},
                                  {"existingSecret": "mine", "redisPasswordKey": "api-token"}])
def test_two_secrets_under_one_key_are_refused(keys: dict[str, str]) -> None:
    """The API's token under the checkpoint token's key would let every API client push weights; the Redis
    password, which every container holds, under the API token's key would hand the API token to them all."""
    with pytest.raises(helm.HelmRenderError, match=r"secrets: apiTokenKey, checkpointTokenKey and redisPasswordKey "
                                                   r"\(.*\) must be three different keys"):
        render({"secrets": keys})


@pytest.mark.parametrize("args", [["--host=0.0.0.0"], ["--host", "0.0.0.0"], ["--port=31000"],
                                  ["--model-path=/models/other"], ["--model", "/models/other"]])
def test_sglang_args_cannot_move_what_the_chart_sets(args: list[str]) -> None:
    """SGLang's routes (a weight load among them) have no login: it listens on the pod's loopback, on engine.port,
    serving model.path, which the rollout server is told; an extra flag would override them."""
    with pytest.raises(helm.HelmRenderError, match=rf"engine\.sglang\.args: {re.escape(args[0])}: the chart sets"):
        render({"engine": {"backend": "sglang", "sglang": {"args": args}}})
    extra = ["--tp-size=2", "--mem-fraction-static=0.8"]
    rendered = render({"engine": {"backend": "sglang", "sglang": {"args": extra}}})
    assert containers(find(rendered, "StatefulSet", "-rollout"))["sglang"]["args"][-2:] == extra


def test_run_config_cannot_set_what_the_sglang_command_line_overrides() -> None:
    """With the SGLang sidecar the rollout servers' command line sets these, so a runConfig value did nothing; the
    embedded engine's servers take engine.ready_timeout_s from the run config."""
    for dotted, value, owner in (("engine.ready_timeout_s", 7200, "engine.sglang.startupSeconds"),
                                 ("engine.urls", ["http://127.0.0.1:31000"], "SGLang sidecar")):
        field = dotted.split(".")[1]
        with pytest.raises(helm.HelmRenderError, match=rf"runConfig\.{re.escape(dotted)}: .*{owner}"):
            render({"engine": {"backend": "sglang"}, "runConfig": {"engine": {field: value}}})
    embedded = render({"runConfig": {"engine": {"ready_timeout_s": 7200}}})
    assert "ready_timeout_s: 7200" in find(embedded, "ConfigMap", "-config")["data"]["run.yaml"]


@pytest.mark.parametrize("name", [".", "..", ".hidden", "-x", "a b"])
def test_the_chart_refuses_a_run_name_the_components_refuse(name: str) -> None:
    """Helm took names every component then refused at start (exit 2, restarted by Kubernetes for ever)."""
    with pytest.raises(ConfigError, match=r"run\.name: String should match pattern"):
        load_config(None, [f"run.name={name}"], env={})
    with pytest.raises(helm.HelmValuesError, match=r"/run/name"):
        render({"run": {"name": name}})
    for fine in ("a.b", "_x", "run-1"):
        assert load_config(None, [f"run.name={fine}"], env={}).run.name == fine
        assert f"name: {fine}" in find(render({"run": {"name": fine}}), "ConfigMap", "-config")["data"]["run.yaml"]


@pytest.mark.parametrize("body, line, key", [
    ("rollout:\n  n_samples: 4\n  max_total_tokens: 4096\n", 3, "rollout.max_total_tokens"),
    ("trainer:\n  advantage: rloo\nrollout:\n  n_samples: 1\n", 4, "rollout.n_samples"),
    ("trainer:\n  advantage: gae\nbuffer:\n  filter_degenerate_groups: true\n", 4, "buffer.filter_degenerate_groups"),
    ("model:\n  lora:\n    rank: 4\nplacement:\n  mode: colocated\n", 2, "model.lora"),
    ("placement:\n  mode: colocated\ntrainer:\n  dist_timeout_s: 60\n", 4, "trainer.dist_timeout_s"),
])
def test_a_check_across_sections_names_the_file_line_of_its_key(tmp_path: Path, body: str, line: int, key: str) -> None:
    """The config's own checks across sections said ``<root>``, with no line of the file: each names its key's."""
    path = tmp_path / "run.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert str(err.value).splitlines()[1].strip().startswith(f"{path}:{line}: {key}: ")


def test_a_check_across_sections_names_no_line_for_a_default_or_an_override(tmp_path: Path) -> None:
    """No line where the file does not hold the key (its default broke the check) or an override set it."""
    path = tmp_path / "run.yaml"
    for body, override in (("rollout:\n  n_samples: 4\n", "engine.max_context=256"),
                           ("rollout:\n  max_total_tokens: 1024\n", "rollout.max_total_tokens=2048")):
        path.write_text(body)
        with pytest.raises(ConfigError) as err:
            load_config(path, [override], env={})
        assert str(err.value).splitlines()[1].strip().startswith("rollout.max_total_tokens: rollout.max_total_tokens")


def test_an_override_under_a_null_section_sets_it(tmp_path: Path) -> None:
    """A dumped config (runs/<run>/config.yaml) writes LoRA off as ``model.lora: null``, and a section whose keys are
    all commented out reads as null: an override under either said "is a value, cannot set" instead of setting it."""
    dumped = tmp_path / "config.yaml"
    dumped.write_text(dump_config(load_config(None, env={})))
    lora = load_config(dumped, ["model.lora.rank=16"], env={}).model.lora
    assert lora is not None and lora.rank == 16
    commented = tmp_path / "run.yaml"
    commented.write_text("trainer:\n  # lr: 1.0e-4\n")
    assert load_config(commented, ["trainer.lr=1e-5"], env={}).trainer.lr == 1e-5
    with pytest.raises(ConfigError, match=r"run\.name: is a value, cannot set run\.name\.x"):
        load_config(dumped, ["run.name.x=1"], env={})


def test_a_secret_from_the_environment_loses_its_newline_and_one_inside_is_refused() -> None:
    """A Kubernetes Secret made from a file (``kubectl create secret --from-file``) hands its trailing newline to the
    environment: every API request was refused (no client can send it) and every push failed in gRPC ("Invalid
    metadata"). Stripped as a secret file is; a line break or control character inside is refused, naming the key."""
    env = {"ROLLWAVE_API_TOKEN": "t" * 40 + "\n", "ROLLWAVE_CHECKPOINT_TOKEN": " " + "c" * 40 + "\r\n"}
    cfg = load_config(None, env=env)
    assert cfg.api.token.get_secret_value() == "t" * 40 and cfg.checkpoint.token.get_secret_value() == "c" * 40
    for inner in ("\n", "\t", "\x00"):
        with pytest.raises(ConfigError, match=r"checkpoint\.token: holds a line break or a control character.*"
                                              r"given in checkpoint\.token_file or ROLLWAVE_CHECKPOINT_TOKEN") as err:
            load_config(None, env={"ROLLWAVE_CHECKPOINT_TOKEN": "a" * 20 + inner + "b" * 20})
        assert "a" * 20 not in str(err.value)


@pytest.mark.parametrize("entry", ["*example.com", "rw.*.com", "rw.example.com:8000", "http://rw.example.com", ""])
def test_an_allowed_host_no_host_header_can_match_is_refused(entry: str) -> None:
    """A wildcard other than a leading ``*.`` fails TrustedHostMiddleware's assertion, which the API's guard meets
    on every request (500; its probes, exempt, kept the pod ready); a scheme, a port or a path never match (400)."""
    with pytest.raises(ConfigError, match=rf"api\.allowed_hosts: '{re.escape(entry)}' cannot match a Host header"):
        load_config(None, [f'api.allowed_hosts=["{entry}"]'], env={})
    fine = ["*.example.com", "rw.example.com", "10.0.0.5", "[::1]", "localhost", "*"]
    hosts = load_config(None, [f"api.allowed_hosts={fine}"], env={}).api.allowed_hosts
    assert hosts == fine
    client = TestClient(TrustedHostMiddleware(PlainTextResponse("ok"), allowed_hosts=hosts[:-1]))  # no lifespan
    assert [client.get("/", headers={"host": h}).status_code for h in ("a.example.com", "[::1]:8000", "x.org")] == [
        200, 200, 400]
