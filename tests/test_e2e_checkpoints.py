"""End to end on real checkpoints (issue 14): a bf16 model served on CPU, fp32 masters in the trainer.

The pipeline runs as processes (``services.launcher``: two rollout servers with their embedded engines and
receivers, one trainer, the API, the embedded Redis).

- A bf16 checkpoint of the tiny model after a short SFT warm start, with tied embeddings and without: the
  engines serve it in bf16 (``engine.dtype=bfloat16``), the trainer holds fp32 masters, every push is cast
  to bf16 as it streams and commits, versions advance, and greedy held-out accuracy rises.
- Every server refuses every push (the trainer's model has an ``lm_head`` the served one does not): the run
  says so in the log, the published version stays 0, and the API and the trainer's metrics show why.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM

from buffer.redis_server import EmbeddedRedis
from core.checkpoint_format import read_safetensors_header
from core.config import Config, dump_config, load_config
from core.net import free_port
from core.tasks import load_tasks
from core.tiny_model import build_tiny_model
from services.client_cmd import wait_for_job
from services.launcher import LocalStack, components
from tests.stack_helpers import port_of, wait_for
from trainer.checkpoint import Checkpointer
from trainer.sft import warm_start

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SFT_STEPS = 700  # the demo's recipe: fewer steps leave a policy that never gets an answer right
SFT_LR = 1e-3
RL_STEPS = 30
EVAL_TASKS = 64


def untied(model_dir: Path, out: Path) -> Path:
    """The model with its own ``lm_head.weight`` (a copy of the embeddings) instead of a tied one."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    return _save(model, model_dir, out)


def in_bf16(model_dir: Path, out: Path) -> Path:
    return _save(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16), model_dir, out)


def _save(model: torch.nn.Module, model_dir: Path, out: Path) -> Path:
    model.save_pretrained(out)
    for f in model_dir.iterdir():  # tokenizer and chat template
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",):
            shutil.copy2(f, out / f.name)
    return out


def stack_config(tmp_path: Path, model: Path, *overrides: str) -> tuple[Config, Path]:
    cfg = load_config(ROOT / "configs/demo.yaml", [
        "run.name=ckpt", f"run.dir={tmp_path}", f"model.path={model}", "model.init_if_missing=false",
        "rollout.heartbeat_s=0.5", "trainer.checkpoint_every=10", "trainer.take_timeout_s=1",
        f"checkpoint.stage_dir={tmp_path}/stage", f"api.port={free_port()}", *overrides,
    ])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    return cfg, path


def evaluate(api: httpx.Client, label: str) -> float:
    body = {"kind": "eval", "name": label, "source": {"kind": "arith", "split": "test", "limit": EVAL_TASKS,
                                                      "seed": 3}}
    reply = api.post("/v1/jobs", json=body)
    assert reply.status_code == 201, reply.text
    return float(wait_for_job(api, reply.json()["job_id"])["accuracy"])


def api_ready(api: httpx.Client) -> bool:
    try:
        return sum(s["alive"] for s in api.get("/v1/status").json()["servers"]) == 2
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model after a short SFT warm start (with wrong-formula demonstrations RL can correct)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine two threads run several times slower than one
    try:
        tmp = tmp_path_factory.mktemp("sft")
        return warm_start(build_tiny_model(tmp / "base"), tmp / "sft",
                          load_tasks("arith", split="train", limit=4000, seed=1), steps=SFT_STEPS, batch_size=32,
                          lr=SFT_LR)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(3600)  # SFT warm start (shared) + stack + two evaluations + RL, on a loaded 2-core machine
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_bf16_checkpoint_pushes_commit_and_the_policy_learns(tmp_path: Path, sft_model: Path, tied: bool) -> None:
    model = in_bf16(sft_model if tied else untied(sft_model, tmp_path / "untied"), tmp_path / "bf16")
    header = read_safetensors_header(next(model.glob("*.safetensors")))
    assert {m["dtype"] for k, m in header.items() if k != "__metadata__"} == {"BF16"}
    assert ("lm_head.weight" in header) == (not tied)
    cfg, config_path = stack_config(tmp_path, model, "engine.dtype=bfloat16", f"trainer.total_steps={RL_STEPS}",
                                    "trainer.stop_when_drained=false")
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        specs = components(cfg, config_path, server.url, rollout_servers=2, api=True)
        with LocalStack(specs, tmp_path / "logs") as stack, \
                httpx.Client(base_url=f"http://127.0.0.1:{cfg.api.port}", timeout=30) as api:
            wait_for("both rollout servers", lambda: api_ready(api), stack, 240)
            for spec in specs:
                if spec.name.startswith("rollout"):
                    info = httpx.get(f"http://127.0.0.1:{port_of(spec, 'engine.port')}/model_info").json()
                    assert info["dtype"] == "bfloat16"
            before = evaluate(api, "before")
            body = {"kind": "train", "source": {"kind": "arith", "split": "train", "limit": RL_STEPS * 16, "seed": 5}}
            assert api.post("/v1/jobs", json=body).status_code == 201
            wait_for("the RL steps", lambda: stack.finished("trainer-0"), stack, 900)
            published = int(api.get("/v1/status").json()["version"])
            wait_for("both servers at the last version", lambda: [s["version"] for s in api.get(
                "/v1/status").json()["servers"]] == [published] * 2, stack, 60)
            status = api.get("/v1/status").json()
            after = evaluate(api, "after")
            for s in status["servers"]:
                staged = tmp_path / "stage" / s["server_id"] / f"v{s['version']}" / "model.safetensors"
                served = read_safetensors_header(staged)
                assert {m["dtype"] for k, m in served.items() if k != "__metadata__"} == {"BF16"}
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == RL_STEPS and sum(r["push_failures"] for r in records) == 0
    assert sum(r["push_servers_ok"] for r in records) >= RL_STEPS  # commits landed on both servers
    assert status["version"] >= RL_STEPS and not status["stragglers"]
    masters = dcp.FileSystemReader(str(Checkpointer(tmp_path / "ckpt" / "checkpoints", 2).latest())).read_metadata()
    dtypes = {m.properties.dtype for k, m in masters.state_dict_metadata.items() if k.startswith("model.")
              and hasattr(m, "properties")}
    assert dtypes == {torch.float32}
    assert after > before, (before, after)


def test_every_server_refusing_is_loud_and_publishes_nothing(tmp_path: Path) -> None:
    served = build_tiny_model(tmp_path / "tied")
    trainer_model = untied(served, tmp_path / "untied")
    cfg, config_path = stack_config(tmp_path, served, "trainer.total_steps=1000", "buffer.groups_per_step=2",
                                    "rollout.n_samples=2", "rollout.max_new_tokens=16")
    with EmbeddedRedis(tmp_path / "redis", aof=False) as server:
        specs = components(cfg, config_path, server.url, rollout_servers=2, api=True)
        trainer = next(s for s in specs if s.name == "trainer-0")
        trainer.argv.append(f"model.path={trainer_model}")  # an operator's mistake: a model the servers lack
        log = tmp_path / "logs" / "trainer-0.log"
        with LocalStack(specs, tmp_path / "logs") as stack, \
                httpx.Client(base_url=f"http://127.0.0.1:{cfg.api.port}", timeout=30) as api:
            wait_for("both rollout servers", lambda: api_ready(api), stack, 240)
            body = {"kind": "train", "source": {"kind": "arith", "split": "train", "limit": 64, "seed": 5}}
            assert api.post("/v1/jobs", json=body).status_code == 201
            refused = re.compile(r"ERROR version \d+ not published: committed on no server, quorum 2\. "
                                 r"server rollout-\d .*tensor lm_head\.weight: not in the served model")
            wait_for("the refusal in the trainer's log", lambda: bool(refused.search(log.read_text())), stack, 240)
            wait_for("a trainer step", lambda: (api.get("/v1/status").json()["trainer"] or {}).get("step"), stack)
            status = api.get("/v1/status").json()
            assert status["version"] == 0 and status["trainer"]["version"] == "0"
            assert sorted(status["stragglers"]) == ["rollout-0", "rollout-1"]
            for s in status["servers"]:
                push = s["last_push"]
                assert (push["stage"], push["reason"], push["serves"]) == ("stage", "manifest", 0), push
                assert "tensor lm_head.weight: not in the served model" in push["error"]
            metrics = httpx.get(f"http://127.0.0.1:{port_of(trainer, 'trainer.metrics_port')}/metrics").text
            assert re.search(r'rollwave_trainer_push_failures_total\{reason="manifest",server="rollout-0",'
                             r'stage="stage"\} [1-9]', metrics), metrics
            assert re.search(r"rollwave_trainer_push_unpublished_total [1-9]", metrics)
