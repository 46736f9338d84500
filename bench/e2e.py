"""Async against sync, or colocated against decoupled, end to end, in one run: the same workload and the same
number of trainer steps.

Every mode runs the real pipeline as processes (embedded Redis, one rollout server with the embedded engine,
one trainer pushing a version every step). ``rollout.mode=sync`` differs from async only in the schedule
(eta = 0: a batch is generated for the current version only). ``--compare colocated`` runs decoupled async
against ``placement.mode=colocated`` (the engine releases its memory while the trainer trains, and takes the
weights by a local push); ``--compare overlap`` runs colocated against its one-step overlap
(``placement.colocated_staleness=1``: the engine keeps its memory and generates while the trainer trains);
``--compare ahead`` runs async with ``checkpoint.prefill_ahead=false`` (the requests a swap retracts prefilled
again after it) against async as it is (their KV computed under the new weights before the pause);
``--compare share`` runs sync with ``trainer.share_prefix=false`` (each sample's prompt through the trainer's
model again) against sync as it is (a group's prompt once per micro-batch): sync waits on every train step, so
the step's time shows in full; ``--compare admit`` runs async with ``engine.admit_wait_ms=0`` (each request
prefilled at the engine's next step) against async as it is (one that arrives while others decode waits up to
100 ms to be prefilled with later arrivals). ``--compare transport`` runs async with
``checkpoint.stage_transport=grpc`` (each push's bytes in the Stage call) against async as it is (on the
receiver's stage port).
``--compare agents`` runs async with an ``agent`` job (the calculator agent, written against the ``openai`` client,
one process per sample) whose agents run on the rollout server's CPU (``placement.agent_cpus`` empty) against the
same with the agents free to run on every CPU (``placement.agent_cpus`` all of them, as the demo sets).
``--compare unpinned`` runs async on the defaults, nothing pinned and torch's own thread count in the engine and
the trainer (as many threads as cores each), with their idle OpenMP threads spinning a while before they sleep
(libgomp's default, ``OMP_WAIT_POLICY`` empty) against sleeping at once (``PASSIVE``, what the launcher gives
unpinned components unless the variable is set).
The model is the tiny one after the demo's SFT warm start, so episodes are multi-turn with real tool calls and
about half of them earn the reward: every step has a gradient and every push new weights.

Placement as in the demo: the rollout server and its engine pinned to one CPU, the trainer to another
(``placement.rollout_cpus`` / ``trainer_cpus``, one torch thread each); colocated, both take turns on both CPUs
(the one device they share), and overlapped both run on both CPUs at once, one torch thread each.
``--no-placement`` leaves them to the scheduler (one torch thread each). Each mode runs ``--runs`` times (3), in
alternating order (A, B, B, A, ...), and the medians are reported.

Prints per run and, as medians, per mode: trajectories/s, trained tokens/s, the mean training reward, trainer
idle fraction (time waiting for data / wall) and how long after the tasks' submission its first batch came (the
pipeline's fill, which async cannot overlap and a short run weighs heavily), rollout idle fraction (time with no
group in flight or paused for a weight swap / wall), and the memory held while the trainer trains: the trainer's
parameters and optimizer state (from its tensors) plus the engine's weights, spare weights and KV cache
(``rollwave_engine_memory_bytes``, sampled every 0.25 s while the trainer holds the device; decoupled or
overlapped, it always does). These are tensor bytes, what a GPU's allocator would hold, not the processes' RSS.
Then the tokens the engine generated per token trained (above 1: groups generated and never trained, as async's
past the last step, or dropped as stale, whose count follows), its prompt tokens per generated token, the share of
prompt tokens taken from its prefix cache, and, where the rollout and the trainer are pinned to CPUs of their own,
the CPU time each side's CPUs were busy per trajectory (``/proc/stat``; the machine otherwise idle): what a
trajectory costs, which the wall-clock rates cannot tell apart from waiting.
Each run trains 30 steps (``--steps``), a third of the demo's 100: async pays once per run for what it cannot
overlap, the first batch's generation (about 1 s), and until the run's budget (admission stops at the groups the
trainer trains) the groups it generated past the last step, which at 12 steps weighed 8x more than in the demo.
Last line: ``<B>_vs_<A> ratio <median trajectories/s B / A>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import httpx
import psutil
import redis

# bench/buffer.py sits beside this file: put the repository first so `import buffer` finds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.colocation import DeviceTurns
from buffer.keys import Keys
from buffer.redis_server import EmbeddedRedis
from buffer.registry import ServerRegistry
from buffer.task_queue import TaskQueue
from core.config import dump_config, load_config
from core.jobs import JobSpec, TaskSource
from services.demo import policy
from services.launcher import LocalStack, components, ensure_checkpoint_token

AGENT = "rollout_server.agents.calculator_agent:run"  # the job's agent in the agents_* modes
MODES = {
    "sync": ["rollout.mode=sync"],
    "async": ["rollout.mode=async"],
    "colocated": ["rollout.mode=async", "placement.mode=colocated"],
    "overlap": ["rollout.mode=async", "placement.mode=colocated", "placement.colocated_staleness=1"],
    "reprefill": ["rollout.mode=async", "checkpoint.prefill_ahead=false"],
    "sync_per_sample": ["rollout.mode=sync", "trainer.share_prefix=false"],
    "admit_at_once": ["rollout.mode=async", "engine.admit_wait_ms=0"],
    "stage_in_call": ["rollout.mode=async", "checkpoint.stage_transport=grpc"],
    "agents_on_rollout_cpu": ["rollout.mode=async", f"rollout.agent_allowlist={json.dumps([AGENT])}"],
    "agents_on_any_cpu": ["rollout.mode=async", f"rollout.agent_allowlist={json.dumps([AGENT])}"],
    "unpinned_spin": ["rollout.mode=async"],
    "unpinned": ["rollout.mode=async"],
}
# what the components inherit besides the config; an empty OMP_WAIT_POLICY is libgomp's default (spin a while, then
# sleep), which unpinned components ran before the launcher gave them PASSIVE where it is not set
MODE_ENV = {"unpinned_spin": {"OMP_WAIT_POLICY": ""}}
COMPARE = {"sync": ("sync", "async"), "colocated": ("async", "colocated"), "overlap": ("colocated", "overlap"),
           "ahead": ("reprefill", "async"), "share": ("sync_per_sample", "sync"),
           "admit": ("admit_at_once", "async"), "unpinned": ("unpinned_spin", "unpinned"),
           "agents": ("agents_on_rollout_cpu", "agents_on_any_cpu"), "transport": ("stage_in_call", "async")}
SAMPLE_S = 0.25  # each scrape takes cycles from the engine and the rollout server
RUN_TIMEOUT_S = 1800.0  # a run of the bench takes a minute or two here: far past it, the trainer is stuck
TOKENS = tuple(f"rollwave_engine_{kind}_tokens_total" for kind in ("prompt", "cached", "generated"))
MEMORY = tuple(f'rollwave_engine_memory_bytes{{kind="{kind}"}}' for kind in ("weights", "kv_cache", "spare_weights"))


def placement(mode: str, pinned: bool) -> list[str]:
    """The demo's placement: the rollout server and engine on the first usable CPU, the trainer on the last;
    colocated, each on all of them in its turn; overlapped, both on all of them at once, one thread each (two
    each would thrash); the unpinned modes, nothing (the defaults); ``agents_on_any_cpu`` adds its agents on all."""
    if mode.startswith("unpinned"):
        return []
    cpus = sorted(os.sched_getaffinity(0))
    if not pinned or len(cpus) < 2:
        return ["engine.threads=1", "trainer.threads=1"]
    if mode == "overlap":
        return [f"placement.rollout_cpus={cpus}", f"placement.trainer_cpus={cpus}", "engine.threads=1",
                "trainer.threads=1"]
    if mode == "colocated":
        return [f"placement.rollout_cpus={cpus}", f"placement.trainer_cpus={cpus}"]
    agents = [f"placement.agent_cpus={cpus}"] if mode == "agents_on_any_cpu" else []
    return [f"placement.rollout_cpus=[{cpus[0]}]", f"placement.trainer_cpus=[{cpus[-1]}]", *agents]


def cpu_busy_s(cpus: list[int]) -> float:
    """Seconds the CPUs ``cpus`` have been busy since boot: every state but idle, iowait and steal (the time the
    host took)."""
    per_cpu = psutil.cpu_times(percpu=True)
    return sum(t.user + t.nice + t.system + t.irq + t.softirq for t in (per_cpu[i] for i in cpus))


class EngineMemory(threading.Thread):
    """Samples the engine's weight and KV bytes through the rollout server's metrics proxy while the trainer
    holds the device (colocated: its turn; decoupled or overlapped: always); ``peak`` is the largest sum seen."""

    def __init__(self, metrics_address: str, turns: DeviceTurns | None) -> None:
        super().__init__(daemon=True)
        self.url = f"http://{metrics_address}/engine/0/metrics"
        self.turns = turns
        self.peak = 0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as http:  # one client: each new one builds a TLS context, ~10 ms of CPU
            while not self.done.wait(SAMPLE_S):
                turn = self.turns.turn() if self.turns is not None else None
                if self.turns is not None and (turn is None or turn.holder != "trainer"):
                    continue
                lines = http.get(self.url).text.splitlines()
                held = sum(float(line.split()[1]) for line in lines if line.startswith(MEMORY))
                if turn is None or self.turns.turn() == turn:  # still the trainer's turn after the read
                    self.peak = max(self.peak, int(held))
                    self.samples += 1


def run_mode(mode: str, name: str, model: Path, root: Path, steps: int, overrides: list[str]) -> dict[str, float]:
    cfg = load_config(None, [
        f"run.name={name}", f"run.dir={root}", f"model.path={model}", *MODES[mode], "rollout.metrics_port=0",
        f"trainer.total_steps={steps}", "trainer.checkpoint_every=1000", *overrides,
    ])
    ensure_checkpoint_token(cfg)
    run_dir = cfg.run.path
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))
    n_tasks = steps * cfg.buffer.groups_per_step * 3
    spec = JobSpec(source=TaskSource(kind="arith", split="train", limit=n_tasks, seed=7),
                   agent=AGENT if mode.startswith("agents") else None)
    tasks = spec.source.load()
    with EmbeddedRedis(run_dir / "redis", aof=False) as server, mock.patch.dict(os.environ, MODE_ENV.get(mode, {})):
        client = redis.Redis.from_url(server.url)
        keys = Keys(cfg.run.name)
        queue = TaskQueue(client, keys, cfg.buffer)
        queue.ensure_groups()
        specs = components(cfg, config_path, server.url, api=False, trainer_args=())
        with LocalStack(specs, run_dir / "logs") as stack:
            registry = ServerRegistry(client, keys)
            deadline = time.monotonic() + 300
            while not registry.live_servers():  # check_refused: a component given up on raises, not waits for ever
                stack.check_refused()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: no rollout server registered in 300 s (logs in {stack.log_dir})")
                time.sleep(0.2)
            turns = cfg.placement.mode == "colocated" and cfg.placement.colocated_staleness == 0
            memory = EngineMemory(registry.live_servers()[0].metrics_address,
                                  DeviceTurns(client, keys) if turns else None)
            memory.start()
            sides = (cfg.placement.rollout_cpus, cfg.placement.trainer_cpus)
            busy_before = [cpu_busy_s(cpus) for cpus in sides]
            started, started_unix = time.monotonic(), time.time()
            queue.submit("bench", [t.model_dump() for t in tasks], "train", spec.model_dump_json())
            run_deadline = started + RUN_TIMEOUT_S
            while not stack.finished("trainer-0"):
                stack.check_refused()
                if time.monotonic() > run_deadline:
                    raise TimeoutError(f"{name}: trainer-0 did not finish its {steps} steps in {RUN_TIMEOUT_S:g} s "
                                       f"(logs in {stack.log_dir})")
                time.sleep(0.05)
            wall = time.monotonic() - started
            busy = [cpu_busy_s(cpus) - before for cpus, before in zip(sides, busy_before, strict=True)]
            memory.done.set()
            memory.join()
            engine = dict.fromkeys(TOKENS, 0.0)
            for line in httpx.get(memory.url, timeout=10).text.splitlines():
                if line.startswith(TOKENS):
                    engine[line.split()[0]] = float(line.split()[1])
            if not memory.samples:
                raise RuntimeError(f"{name}: no engine memory sample was taken while the trainer held the device")
            stats = [s.stats for s in registry.live_servers()]
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trajectories = sum(r["samples"] for r in records)
    # the trainer waits from its own start, before the clock: count its idle time from the clock's start
    first_wait = records[0]["time"] - records[0]["step_time_s"] - started_unix
    idle = sum(r["wait_s"] for r in records) - max(0.0, records[0]["wait_s"] - first_wait)
    rollout_busy = sum(s.get("busy_s", 0.0) - s.get("paused_s", 0.0) for s in stats)
    trainer_bytes = max(r["held_bytes"] for r in records)
    apart = all(sides) and not set(sides[0]) & set(sides[1])  # else one CPU's time is both sides'
    return {
        "trajectories_per_s": trajectories / wall,
        "tokens_per_s": sum(r.get("loss_tokens", 0) for r in records) / wall,
        "reward": statistics.mean(r["reward_mean"] for r in records),
        "trainer_idle_fraction": idle / wall,
        "first_wait_s": first_wait,
        "rollout_idle_fraction": max(0.0, 1.0 - rollout_busy / wall),
        "wall_s": wall,
        "trainer_mib": trainer_bytes / 2**20,
        "engine_mib": memory.peak / 2**20,
        "training_peak_mib": (trainer_bytes + memory.peak) / 2**20,
        "prompt_per_generated": engine[TOKENS[0]] / max(engine[TOKENS[2]], 1.0),
        "generated_per_trained": engine[TOKENS[2]] / max(sum(r.get("loss_tokens", 0) for r in records), 1),
        "stale_dropped": sum(r.get("stale_dropped", 0) for r in records),
        "cached_fraction": engine[TOKENS[1]] / max(engine[TOKENS[0]], 1.0),
        "rollout_cpu_ms": 1e3 * busy[0] / trajectories if apart else float("nan"),
        "trainer_cpu_ms": 1e3 * busy[1] / trajectories if apart else float("nan"),
    }


def report(label: str, r: dict[str, float]) -> None:
    print(f"{label:>10}: {r['trajectories_per_s']:.2f} trajectories/s  {r['tokens_per_s']:.0f} tokens/s  "
          f"reward {r['reward']:.2f}  "
          f"trainer idle {r['trainer_idle_fraction']:.2f} (first batch {r['first_wait_s']:.1f} s)  "
          f"rollout idle {r['rollout_idle_fraction']:.2f}  ({r['wall_s']:.1f} s)  "
          f"held while training: {r['training_peak_mib']:.2f} MiB (trainer {r['trainer_mib']:.2f} + engine "
          f"{r['engine_mib']:.2f})  generated/trained tokens {r['generated_per_trained']:.2f} "
          f"({r['stale_dropped']:.0f} groups dropped as stale), "
          f"prompt/generated tokens {r['prompt_per_generated']:.1f}, "
          f"cached {r['cached_fraction']:.2f}  CPU ms per trajectory: rollout {r['rollout_cpu_ms']:.1f}, "
          f"trainer {r['trainer_cpu_ms']:.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30,
                   help="trainer steps per run: the demo runs 100, and the pipeline's fill weighs on a short run as it "
                   "never does on a long one")
    p.add_argument("--sft-steps", type=int, default=700,
                   help="the demo's SFT warm start (fewer steps leave a policy that earns no reward, so no gradient)")
    p.add_argument("--warm-start", type=Path, metavar="DIR",
                   help="start from this SFT warm start (an earlier demo's runs/<name>/sft) instead of making one")
    p.add_argument("--runs", type=int, default=3, help="runs of each mode, in alternating order")
    p.add_argument("--no-placement", action="store_true", help="pin nothing (one torch thread per component)")
    p.add_argument("--compare", choices=sorted(COMPARE), default="sync",
                   help="sync: sync against async; colocated: decoupled async against colocated; overlap: "
                   "colocated against its one-step overlap; ahead: async re-prefilling after each swap against "
                   "async with the KV computed ahead; share: sync training each sample's prompt against sync "
                   "training a group's prompt once; admit: async admitting each request at once against async; "
                   "transport: async with each push's bytes in the Stage call against async; "
                   "agents: an agent job's agents on the rollout server's CPU against on every CPU; "
                   "unpinned: async, nothing pinned, OpenMP's threads spinning against sleeping at once")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    first, second = COMPARE[args.compare]
    results: dict[str, list[dict[str, float]]] = {first: [], second: []}
    for mode in results:
        print(f"{mode} placement: " + " ".join(placement(mode, not args.no_placement)))
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None  # staging and local pushes on tmpfs, removed after
    with tempfile.TemporaryDirectory(prefix="rollwave-e2e-") as tmp, \
            tempfile.TemporaryDirectory(prefix="rollwave-e2e-stage-", dir=shm) as stage:
        root = Path(tmp)
        model = policy(load_config(None, []), root, args.sft_steps, args.warm_start)
        for i in range(args.runs):
            for mode in (first, second) if i % 2 == 0 else (second, first):
                overrides = [*placement(mode, not args.no_placement), f"checkpoint.stage_dir={stage}", *args.overrides]
                results[mode].append(run_mode(mode, f"e2e-{mode}-{i}", model, root, args.steps, overrides))
                report(f"{mode} #{i + 1}", results[mode][-1])
    median = {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}
    for mode, r in median.items():
        report(f"{mode} median", r)
    ratio = median[second]["trajectories_per_s"] / median[first]["trajectories_per_s"]
    print(f"{second}_vs_{first} ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
