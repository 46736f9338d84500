"""``make demo``: the whole pipeline on embedded defaults, from an empty machine to a learning curve.

build the tiny model -> SFT warm start on flawed tool-use demonstrations -> embedded Redis ->
rollout server + trainer + API as processes -> held-out eval -> fully async RL -> held-out eval ->
summary, learning curve and the final HF checkpoint in ``runs/<id>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import secrets
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
from tqdm import tqdm

from buffer.keys import Keys
from buffer.redis_server import client_for, configured_url, connect
from core.config import CONFIG_ERROR_EXIT, Config, ConfigError, dump_config, load_config, load_config_or_exit
from core.process import refuse_inspection
from core.tasks import load_tasks
from core.tiny_model import build_tiny_model
from services.cli import failed_request
from services.client_cmd import wait_for_job
from services.launcher import ComponentGivenUp, LocalStack, components, ensure_checkpoint_token, published_api_url
from services.report import histogram_totals, learning_curve, summarize
from trainer.sft import warm_start

ROOT = Path(__file__).resolve().parent.parent
DEMO_CONFIG = ROOT / "configs/demo.yaml"
log = logging.getLogger("demo")
API_FOLLOW_S = 120.0  # how long a request waits for a restarted API: the launcher's longest backoff (30 s), its start
FOLLOW_POLL_S = 0.5  # the pause before a refused request is sent again


class ApiClient(httpx.Client):
    """The demo's client of the run's API, which follows it across a restart: the launcher restarts an API that
    crashed, and with ``api.port=0`` the new one binds another port and publishes its URL (``published_api_url``).
    A request whose connection is refused is sent again, to the URL published then, until one takes it; after
    ``follow_s``, ``TimeoutError`` names the API and ``stage`` (what the demo was doing). A request's own connect
    timeout, when shorter, ends it sooner, with ``httpx.ConnectTimeout`` as a connect would: ``wait_for_job`` bounds
    each poll by what is left of its deadline that way, and rides that out as an outage. A refused connection
    carried nothing, so a job's submit is not made twice."""

    def __init__(self, client: redis.Redis, keys: Keys, check: Callable[[], None] | None = None,
                 follow_s: float = API_FOLLOW_S, **kwargs: Any) -> None:
        """``check`` ends a wait for the API (``LocalStack.check_refused``: one it gave up on never comes back)."""
        self.stage = "the start"
        self._redis, self._keys, self._check, self.follow_s = client, keys, check, follow_s
        super().__init__(base_url=published_api_url(client, keys, follow_s, check), **kwargs)

    def send(self, request: httpx.Request, **kwargs: Any) -> httpx.Response:
        connect_s = request.extensions.get("timeout", {}).get("connect")
        follow_s = self.follow_s if connect_s is None else min(self.follow_s, connect_s)
        deadline = time.monotonic() + follow_s
        while True:
            try:
                return super().send(request, **kwargs)
            except httpx.ConnectError as exc:
                refused = f"{request.url.scheme}://{request.url.netloc.decode('ascii')}"
                url = self._published(deadline - time.monotonic())
                if url is None:
                    gone = (f"the API of run {self._keys.run} refused connections at {refused} during {self.stage}, "
                            f"and published no address that takes one within {follow_s:g} s")
                    if follow_s < self.follow_s:
                        raise httpx.ConnectTimeout(f"{gone}: the request's connect timeout", request=request) from exc
                    raise TimeoutError(f"{gone} (see its log)") from exc
            if (url.host, url.port) != (self.base_url.host, self.base_url.port):
                log.warning("the API at %s refused a connection during %s; it published %s since: following it",
                            refused, self.stage, url)
            self.base_url = url
            request.url = request.url.copy_with(scheme=url.scheme, host=url.host, port=url.port)
            request.headers["Host"] = request.url.netloc.decode("ascii")  # the API checks it (api.allowed_hosts)

    def _published(self, left_s: float) -> httpx.URL | None:
        """The API's URL as published after a pause (None: none within ``left_s``)."""
        if self._check is not None:
            self._check()
        if left_s <= 0:
            return None
        time.sleep(min(FOLLOW_POLL_S, left_s))
        try:
            return httpx.URL(published_api_url(self._redis, self._keys, left_s, self._check))
        except TimeoutError:
            return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.demo", description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", default=str(DEMO_CONFIG))
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--sft-steps", type=int, default=700)
    p.add_argument("--warm-start", type=Path, metavar="DIR",
                   help="start RL from this SFT warm start (an earlier run's runs/<name>/sft) instead of making one")
    p.add_argument("--eval-tasks", type=int, default=200, help="held-out arith problems per evaluation")
    p.add_argument("--timeout-min", type=float, default=14.0,
                   help="give up on RL, or on an eval job, after this many minutes")
    p.add_argument("--agent", metavar="MODULE:FUNCTION",
                   help="train and evaluate this OpenAI-client agent (an agent job, allowed on the demo's server) "
                        "instead of the built-in agent loop, e.g. rollout_server.agents.calculator_agent:run")
    return p


def policy(cfg: Config, run_dir: Path, sft_steps: int, warm_start_dir: Path | None) -> Path:
    """The RL run's starting policy: ``warm_start_dir`` when given (it must hold an HF model), else a fresh
    SFT warm start of ``sft_steps``."""
    if warm_start_dir is None:
        return _sft(cfg, run_dir, sft_steps)
    if not (warm_start_dir / "config.json").is_file():
        raise SystemExit(f"--warm-start {warm_start_dir}: no HF model there (no config.json)")
    return warm_start_dir.absolute()


def _sft(cfg: Config, run_dir: Path, steps: int) -> Path:
    base = build_tiny_model(run_dir / "base", seed=cfg.model.seed)
    tasks = load_tasks("arith", split="train", limit=4000, seed=cfg.run.seed + 1)
    with tqdm(total=steps, desc="SFT warm start", unit="step") as bar:

        def progress(step: int, loss: float) -> None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")

        return warm_start(base, run_dir / "sft", tasks, steps=steps, seed=cfg.run.seed, progress=progress,
                          source="task set arith (split train, limit 4000)")


@contextlib.contextmanager
def run_redis(cfg: Config, run_dir: Path) -> Iterator[str]:
    """The run's Redis URL: ``REDIS_URL`` or ``redis.url``, else an embedded server's, started as every component
    starts one (``connect``: the ``redis.*`` keys, data dir, fsync, socket, port) and stopped after."""
    client, server = connect(cfg.redis, run_dir)
    client.close()  # the stack's components and the demo's own client connect by the URL
    try:
        yield server.url if server is not None else str(configured_url(cfg.redis))
    finally:
        if server is not None:
            server.stop()


def _evaluate(api: httpx.Client, n: int, seed: int, label: str, agent: str | None,
              timeout_s: float) -> tuple[float, float]:
    """(accuracy, share of the answers that called a tool) of a greedy eval job on ``n`` held-out problems."""
    body = {"kind": "eval", "name": label, "source": {"kind": "arith", "split": "test", "limit": n, "seed": seed},
            "agent": agent}
    reply = api.post("/v1/jobs", json=body)
    reply.raise_for_status()
    job = wait_for_job(api, reply.json()["job_id"], timeout_s)
    samples, cursor = [], ""
    while cursor is not None:
        page = api.get(f"/v1/jobs/{job['job_id']}/trajectories", params={"cursor": cursor, "limit": 200}).json()
        samples += page["items"]
        cursor = page["next"]
    return float(job["accuracy"]), sum(bool(s["tool_calls"]) for s in samples) / max(len(samples), 1)


def _wait_ready(api: httpx.Client, stack: LocalStack, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stack.check_refused()
        try:
            status = api.get("/v1/status").json()
            if any(s["alive"] for s in status["servers"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no rollout server registered within {timeout_s:.0f} s")


def _train(api: httpx.Client, stack: LocalStack, cfg: Config, timeout_s: float, agent: str | None) -> dict[str, Any]:
    n_tasks = cfg.trainer.total_steps * cfg.buffer.groups_per_step * 2
    body = {"kind": "train", "name": "rl", "source": {"kind": "arith", "split": "train", "limit": n_tasks,
                                                       "seed": cfg.run.seed + 2}, "agent": agent}
    reply = api.post("/v1/jobs", json=body)
    reply.raise_for_status()
    job_id = reply.json()["job_id"]
    deadline = time.monotonic() + timeout_s
    schedule = "colocated" if cfg.placement.mode == "colocated" else cfg.rollout.mode
    with tqdm(total=cfg.trainer.total_steps, desc=f"{schedule} RL", unit="step") as bar:
        while not stack.finished("trainer-0"):
            stack.check_refused()
            if time.monotonic() > deadline:
                raise TimeoutError(f"RL did not finish {cfg.trainer.total_steps} steps in {timeout_s:.0f} s")
            trainer = api.get("/v1/status").json()["trainer"] or {}
            bar.n = int(trainer.get("step", 0))
            bar.set_postfix(version=trainer.get("version"), reward=trainer.get("reward_mean"))
            bar.refresh()
            time.sleep(1.0)
        bar.n = cfg.trainer.total_steps
        bar.refresh()
    reply = api.post(f"/v1/jobs/{job_id}/cancel")  # the extra tasks; 409: every group trained or dropped, none left
    if reply.status_code == 409:
        reply = api.get(f"/v1/jobs/{job_id}")
    reply.raise_for_status()
    return reply.json()


def _generation_stalls(status: dict[str, Any]) -> tuple[float, float]:
    """(count, total seconds) of the swaps' generation stalls on each rollout server's engine (the demo's
    servers run one), read through the server's metrics; the embedded engine measures them."""
    count = total = 0.0
    for server in status["servers"]:
        if server["metrics_address"]:
            reply = httpx.get(f"http://{server['metrics_address']}/engine/0/metrics", timeout=30)
            reply.raise_for_status()
            n, s = histogram_totals(reply.text, "rollwave_engine_generation_stall_seconds")
            count, total = count + n, total + s
    return count, total


def run(cfg: Config, sft_steps: int, eval_tasks: int, timeout_s: float,
        warm_start_dir: Path | None = None, agent: str | None = None) -> dict[str, Any]:
    """The whole demo; with ``agent`` its train and eval jobs run that OpenAI-client agent per sample."""
    run_dir = cfg.run.path.absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    cfg.model.path = policy(cfg, run_dir, sft_steps, warm_start_dir)
    cfg.api.port = 0  # any free port; the API publishes the one it bound
    if agent is not None:
        cfg.rollout.agent_allowlist = [*cfg.rollout.agent_allowlist, agent]
    if cfg.api.token is None:
        cfg.api.token = secrets.token_urlsafe(32)
    ensure_checkpoint_token(cfg)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))  # secrets masked: the components get theirs in the environment
    auth = {"Authorization": f"Bearer {cfg.api.token.get_secret_value()}"}
    try:
        with run_redis(cfg, run_dir) as redis_url:
            specs = components(cfg, config_path, redis_url)  # a restarted trainer resumes from its checkpoint
            with LocalStack(specs, run_dir / "logs") as stack, \
                    client_for(redis_url, cfg.redis) as client, \
                    ApiClient(client, Keys(cfg.run.name), stack.check_refused, headers=auth,
                              timeout=httpx.Timeout(30, connect=API_FOLLOW_S)) as api:
                api.stage = "the wait for a rollout server"
                _wait_ready(api, stack)
                api.stage = "the held-out eval before RL"
                before, tools_before = _evaluate(api, eval_tasks, cfg.run.seed + 3, "held-out before RL", agent,
                                                timeout_s)
                api.stage = "RL"
                rl_started = time.monotonic()
                job = _train(api, stack, cfg, timeout_s, agent)
                rl_seconds = time.monotonic() - rl_started
                api.stage = "the held-out eval after RL"
                after, tools_after = _evaluate(api, eval_tasks, cfg.run.seed + 3, "held-out after RL", agent,
                                              timeout_s)
                api.stage = "the final status"
                status = api.get("/v1/status").json()
                stalls, stalled_s = _generation_stalls(status)
    finally:  # every component has stopped: the run's staging area (local pushes) would hold tmpfs RAM for good
        shutil.rmtree(cfg.checkpoint.stage_dir / cfg.run.name, ignore_errors=True)
    final = run_dir / "final"
    from trainer.checkpoint import Checkpointer, export_hf

    export_hf(Checkpointer(run_dir / "checkpoints", cfg.trainer.keep_checkpoints).latest(), cfg.model.path, final,
              cfg.model.lora, merge=True)  # with LoRA: the merged model, the adapter in final/adapter
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    learning_curve(records, before, after, run_dir / "learning_curve.png")
    summary = summarize(records, job, status, before=before, after=after, rl_seconds=rl_seconds,
                        total_seconds=time.monotonic() - started, run_dir=run_dir)
    summary.update(heldout_tool_use_before=round(tools_before, 3), heldout_tool_use_after=round(tools_after, 3),
                   generation_stalls=int(stalls),
                   generation_stall_ms_mean=round(1e3 * stalled_s / stalls, 2) if stalls else None)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    refuse_inspection()  # it holds every secret of the run, the ones it makes included
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the stack and Redis
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config_or_exit(args.config, [f"run.name=demo-{time.strftime('%Y%m%d-%H%M%S')}", *args.overrides])
    if "path" in cfg.model.model_fields_set and cfg.model.path != load_config(DEMO_CONFIG, []).model.path:
        overridden = any(o.partition("=")[0].strip() == "model.path" for o in args.overrides)  # run() sets its own:
        where = "" if overridden else f"{args.config}: "  # one given (not the demo config's, or a copy's) is refused
        print(f"error: {where}model.path: the demo starts RL from an SFT warm start of the tiny model it makes, or "
              "from --warm-start DIR (an HF model); a run on a model of yours is `rollwave up -c run.yaml`",
              file=sys.stderr)
        return CONFIG_ERROR_EXIT
    try:
        summary = run(cfg, args.sft_steps, args.eval_tasks, args.timeout_min * 60, args.warm_start, args.agent)
    except ConfigError as exc:  # a component refused its config (the stack is down by now)
        print(f"error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except ComponentGivenUp as exc:  # one failed at every start (the stack is down by now): its error names its log
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:  # the stack is down by now; say which call failed (logs under runs/<run>/logs)
        logs = cfg.run.path / "logs"
        raise SystemExit(f"demo: {failed_request(exc)}: {type(exc).__name__}: {exc} (see {logs})") from exc
    print("\n".join(f"{k:>28}: {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
