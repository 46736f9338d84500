"""Trainer metrics: Prometheus series in a registry this object owns, ``metrics.jsonl`` in the run dir,
and the run's Redis status (``rw:<run>:trainer`` hash, ``rw:<run>:steps`` stream) that the API reads.

Only rank 0 records and serves (the step's figures are already reduced over ranks); each rank's own step time and
peak memory reach it in the step's reduce, as series labelled ``rank``, so one port shows a slow or memory-hungry rank.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from buffer.keys import TRAINER_FINISHED_FIELDS, Keys
from buffer.replay import ReplayBuffer, TrainerFenced

log = logging.getLogger(__name__)

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
_GAUGES = {
    "reward_mean": "mean reward of the last step's samples",
    "reward_std": "standard deviation of the last step's rewards",
    "is_ratio_mean": "mean behaviour IS weight pi_prox/pi_behav over the last step's trained tokens",
    "is_ratio_max": "largest behaviour IS weight of the last step",
    "clip_fraction": "fraction of trained tokens where the PPO clip was active",
    "masked_token_fraction": "fraction of trained tokens masked by icepop's IS window",
    "kl": "mean k-estimate of KL(pi_theta || pi_ref) per token (0 without a reference model)",
    "entropy": "mean policy entropy per trained token",
    "logprob_gap": "mean |log pi_behav - log pi_prox| per trained token",
    "tokens_per_second": "tokens (prompt + generated) trained per second of the last step",
}
_CRITIC_GAUGES = {  # trainer.advantage=gae only
    "value_loss": "the critic's clipped value loss of the last step",
    "explained_variance": "1 - Var(return - value) / Var(return) over the last step's trained tokens",
}
_HANDOVER = {"wait": "device_wait_s", "onload": "onload_s", "offload": "offload_s"}  # stage: step record key
_FROM_STEP = {"masked_token_fraction": "masked_fraction", "tokens_per_second": "tokens_per_s"}
_RANK_GAUGES = {  # per rank: step record key -> (series, help)
    "rank_compute_s": ("rank_compute_seconds", "seconds the rank spent in the last step before the step's closing "
                       "reduction, which waits for the slowest rank (FSDP's collectives within it wait too)"),
    "rank_peak_memory_bytes": ("rank_peak_memory_bytes", "the rank's peak memory by the end of the last step: on "
                               "CUDA the most torch allocated during it, on the CPU the process's peak resident set"),
}
# KEYS: trainer hash, steps stream. ARGV: the step's record (JSON), the stream's cap, how many status fields and values
# follow, then those. Run fenced by the trainer (ReplayBuffer.fenced_script: its epoch's key and value after these).
_PUBLISH = """
redis.call('HSET', KEYS[1], unpack(ARGV, 4, 3 + tonumber(ARGV[3])))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'metrics', ARGV[1])
"""

# KEYS: the trainer's lease, the trainer hash. ARGV: what names this trainer, the lease's TTL in ms. Run fenced by the
# trainer (ReplayBuffer.fenced_script), so a fenced trainer's lease lapses. The hash's ``leased`` says the run's trainer
# keeps a lease, so the API reads a lapsed one as its death (a trainer from before leases kept none).
_RENEW_LEASE = """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[2], 'leased', '1')
return 0
"""
# KEYS: the trainer's lease. ARGV: what names this trainer. Deletes the lease only while it is this trainer's.
_RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class TrainerMetrics:
    """``rollwave_trainer_*`` series; serve ``.registry`` with ``core.metrics.serve_metrics``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.step_duration = Histogram(
            "rollwave_trainer_step_duration_seconds",
            "train step wall time (excludes waiting for data)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.idle = Counter("rollwave_trainer_idle_seconds_total", "time spent waiting for data, counted at each "
                            "buffer read (trainer.take_timeout_s) while it waits", registry=r)
        self.step = Gauge("rollwave_trainer_step", "train steps completed", registry=r)
        self.version = Gauge("rollwave_trainer_policy_version", "policy version of the weights", registry=r)
        self.staleness = Histogram(
            "rollwave_trainer_staleness",
            "policy version lag of trained samples (versions)",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        self.gauges = {n: Gauge(f"rollwave_trainer_{n}", doc, registry=r) for n, doc in _GAUGES.items()}
        self.critic_gauges = {n: Gauge(f"rollwave_trainer_{n}", doc, registry=r) for n, doc in _CRITIC_GAUGES.items()}
        self.rank_gauges = {key: Gauge(f"rollwave_trainer_{name}", doc, ["rank"], registry=r)
                            for key, (name, doc) in _RANK_GAUGES.items()}
        self.handover = Histogram(
            "rollwave_trainer_device_handover_seconds",
            "placement.mode=colocated: per step, waiting for the engines to release the device (wait), taking the "
            "trainer's memory back (onload), giving it back (offload; trainer.offload)",
            ["stage"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )
        for stage in _HANDOVER:  # exported at 0 where the trainer has its device to itself
            self.handover.labels(stage=stage)
        self.handover_failures = Counter(
            "rollwave_trainer_device_handover_failures_total",
            "placement.mode=colocated: hand-overs of the device that failed, by stage (release: live rollout servers "
            "did not release their engines' memory within placement.colocated_timeout_s; the step fails)",
            ["stage"],
            registry=r,
        )
        self.handover_failures.labels(stage="release")
        self.truncated = Counter(
            "rollwave_trainer_truncated_samples_total", "trained samples cut off by a token limit", registry=r
        )
        self.overlong_masked = Counter(
            "rollwave_trainer_overlong_masked_samples_total",
            "truncated samples left out of the loss (trainer.overlong.mode=mask)",
            registry=r,
        )

        self.skipped_updates = Counter(
            "rollwave_trainer_skipped_updates_total",
            "policy optimizer updates skipped because the gradient norm was not finite (NaN or inf): the weights "
            "stay as they were",
            registry=r,
        )
        self.critic_skipped_updates = Counter(
            "rollwave_trainer_critic_skipped_updates_total",
            "critic optimizer updates (trainer.advantage=gae) skipped because the gradient norm was not finite: the "
            "value model stays as it was",
            registry=r,
        )

    def observe_step(self, record: dict[str, Any]) -> None:
        """Update every series but the policy version (set when a version is made) from one step's record."""
        self.step_duration.observe(record["step_time_s"])
        self.step.set(record["step"])
        for lag, count in record["staleness_hist"].items():
            for _ in range(count):
                self.staleness.observe(int(lag))
        if "onload_s" in record:  # the trainer shares its device
            for stage, key in _HANDOVER.items():
                self.handover.labels(stage=stage).observe(record[key])
        self.truncated.inc(record["truncated"])
        self.overlong_masked.inc(record["overlong_masked"])
        self.skipped_updates.inc(record["skipped_updates"])
        self.critic_skipped_updates.inc(record.get("critic_skipped_updates", 0))
        for name, gauge in self.gauges.items():
            value = record[_FROM_STEP.get(name, name)]
            if math.isfinite(value):
                gauge.set(value)
        for name, gauge in self.critic_gauges.items():
            if name in record and math.isfinite(record[name]):
                gauge.set(record[name])
        for key, gauge in self.rank_gauges.items():
            for rank, value in enumerate(record[key]):
                gauge.labels(rank=str(rank)).set(value)


class MetricsLog:
    """Appends one JSON object per step to ``<run dir>/metrics.jsonl`` (line-buffered; survives a crash)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def start(self) -> MetricsLog:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        return self

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.path}: MetricsLog.write before start()")
        self._file.write(json.dumps(record, sort_keys=True, allow_nan=True) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RedisStatus:
    """Publishes each step to Redis for the API: the ``trainer`` hash (step, version, reward, heartbeat)
    and one ``steps`` stream entry (the record as JSON under ``metrics``, capped at ``max_steps``); and the
    trainer's end (``TRAINER_FINISHED_FIELDS``), so the API can say which train jobs will not be trained."""

    def __init__(self, client: redis.Redis, keys: Keys, max_steps: int = 10_000,
                 fence: ReplayBuffer | None = None) -> None:
        """``fence``: the trainer's buffer; each step is published only while this trainer is the run's newest (one
        call, check and writes: no round trip more than before), else refused (``TrainerFenced``): a fenced trainer
        used to write its steps over the newer trainer's."""
        self.redis = client
        self.keys = keys
        self.max_steps = max_steps
        self._publish = (client.register_script(_PUBLISH) if fence is None
                         else fence.fenced_script(_PUBLISH, "a step in the run's status"))

    def publish_metrics_address(self, address: str) -> None:
        """Where rank 0 serves its Prometheus metrics, as bound (``trainer.metrics_port=0`` picks any)."""
        self.redis.hset(self.keys.trainer, "metrics_address", address)

    def publish(self, record: dict[str, Any], version: int, pushed: int) -> None:
        """One step, with the published ``version`` (a quorum serves it) and the newest ``pushed`` one."""
        status = {
            "step": record["step"],
            "version": version,
            "pushed_version": pushed,
            "reward_mean": record["reward_mean"],
            "loss": record["loss"],
            "tokens_per_s": record["tokens_per_s"],
            "heartbeat": time.time(),
        }
        fields = [x for pair in status.items() for x in pair]
        self._publish([self.keys.trainer, self.keys.steps], [json.dumps(record), self.max_steps, len(fields), *fields])

    def started(self) -> None:
        """A trainer starts: the end an earlier one recorded no longer holds (it trains the run's jobs again)."""
        self.redis.hdel(self.keys.trainer, *TRAINER_FINISHED_FIELDS)

    def finished(self, step: int, reason: str, version: int, pushed: int) -> None:
        """The trainer stopped at ``step`` because of ``reason`` (the config key: ``trainer.total_steps`` or
        ``trainer.stop_when_drained``), with its versions once the last pushes landed: nothing more is trained
        until a trainer starts again, and a wait on a train job with groups left ends on it."""
        now = time.time()
        self.redis.hset(self.keys.trainer, mapping={
            "version": version, "pushed_version": pushed, "heartbeat": now,
            "finished_step": step, "finished_reason": reason, "finished_at": now,
        })


STOP_WAIT_S = 1.0  # how long a trainer's exit waits for a renewal of its lease in flight


class TrainerLease:
    """Rank 0's lease on the run (``Keys.trainer_alive``): a key naming this trainer (pid, host and trainer epoch) that
    expires ``ttl_ms`` (``buffer.claim_idle_ms``) after its last renewal. A thread of its own renews it every third of
    that, so a long step does not let it lapse; only while this trainer is the run's newest (a fenced trainer's renewal
    is refused, logged and counted, and its lease lapses); ``stop`` deletes it (while it is still this trainer's). A
    trainer killed without recording its end (SIGKILL, the OOM killer, a lost node) stops renewing it, so a job's delete
    takes the groups pending for the trainer as no one's once it lapsed, where it used to wait for a trainer to start
    again and take them back. One frozen or cut off from Redis past the TTL is taken so too: its ack of a group the
    delete removed then finds the group's id consumed, and acks and counts nothing."""

    def __init__(self, client: redis.Redis, keys: Keys, fence: ReplayBuffer, ttl_ms: int,
                 registry: CollectorRegistry | None = None) -> None:
        self.key, self.hash = keys.trainer_alive, keys.trainer
        self.ttl_ms = ttl_ms
        self.value = f"pid {os.getpid()} on {socket.gethostname()}, epoch {fence.fence()}"
        self._renew = fence.fenced_script(_RENEW_LEASE, "its lease")
        self._release = client.register_script(_RELEASE_LEASE)
        self.renew_failures = Counter(
            "rollwave_trainer_lease_renew_failures_total",
            "renewals of the trainer's lease (rw:<run>:trainer:alive) that failed (Redis did not answer, or another "
            "error, logged with its traceback): past buffer.claim_idle_ms without one it lapses, and a job's delete "
            "takes the groups the trainer holds",
            registry=registry if registry is not None else CollectorRegistry(),
        )
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="trainer-lease", daemon=True)

    def start(self) -> TrainerLease:
        """Take the lease (raises ``TrainerFenced`` when a newer trainer of the run started), and keep renewing it."""
        self.renew()
        self._thread.start()
        return self

    def renew(self) -> None:
        """Set the lease to expire ``ttl_ms`` from now, only while this trainer is the run's newest."""
        self._renew([self.key, self.hash], [self.value, self.ttl_ms])

    def _keep(self) -> None:
        failing = False
        while not self._stopped.wait(self.ttl_ms / 3000):
            try:
                self.renew()
            except TrainerFenced:  # logged and counted: this trainer stops at its next take; its lease lapses
                return
            except Exception as exc:  # Redis away, or anything else: the thread must live on to renew once it can
                self.renew_failures.inc()
                if not failing:
                    log.warning("%s: renewing the trainer's lease failed (%r): it lapses %g s after the last renewal, "
                                "and a job's delete then takes the groups this trainer holds", self.key, exc,
                                self.ttl_ms / 1000, exc_info=not isinstance(exc, redis.RedisError))
                failing = True
            else:
                if failing:
                    log.info("%s: the trainer's lease is renewed again", self.key)
                failing = False

    def stop(self) -> None:
        """Stop renewing and delete the lease, if it is still this trainer's (a newer trainer's is left alone). A
        renewal still in flight after a second (Redis away: the client rides out an outage for a minute) leaves the
        lease to lapse, rather than hold the trainer's exit that long (past a supervisor's grace period)."""
        self._stopped.set()
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("%s: a renewal of the trainer's lease is still waiting for Redis: the lease is left to lapse "
                        "within %g s", self.key, self.ttl_ms / 1000)
            return
        try:
            self._release([self.key], [self.value])
        except redis.RedisError as exc:
            log.warning("%s: could not delete the trainer's lease (%s): it lapses within %g s", self.key, exc,
                        self.ttl_ms / 1000)
