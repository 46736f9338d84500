"""The run configuration: one YAML file, one tree of small models, one per component.

Layering is defaults < file < dotted command-line overrides (``trainer.lr=1e-5``). Unknown keys, wrong
types and bad values are errors naming the full dotted key.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot be used; the message names the full dotted key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="run id; Redis prefix rw:<name>:")
    dir: Path = Field(Path("runs"), description="parent of the run directory runs/<name>/")
    seed: int = 0

    @property
    def path(self) -> Path:
        return self.dir / self.name


class ModelConfig(Section):
    path: Path = Field(Path("runs/model"), description="HF model directory (built by `rollwave model init`)")
    init_if_missing: bool = Field(True, description="build the tiny model at `path` when it does not exist")
    seed: int = 0


class RedisConfig(Section):
    url: str | None = Field(None, description="external Redis; None starts the embedded redis-server")
    data_dir: Path | None = Field(None, description="embedded Redis data dir (default: <run dir>/redis)")
    aof: bool = Field(True, description="append-only file on the embedded Redis")
    unix_socket: bool = Field(False, description="embedded Redis listens on a unix socket instead of TCP")
    port: int = Field(0, ge=0, le=65535, description="embedded Redis TCP port; 0 picks a free one")
    appendfsync: Literal["always", "everysec"] = Field(
        "everysec", description="embedded Redis AOF fsync: always (no acknowledged write lost) or everysec"
    )


class EngineConfig(Section):
    backend: Literal["embedded", "sglang"] = "embedded"
    urls: list[str] = Field(default_factory=list, description="engine base URLs to use instead of starting one")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    max_batch_size: int = Field(64, ge=1)
    max_context: int = Field(1024, ge=16, description="prompt + generation tokens per request")
    request_timeout_s: float = Field(600.0, gt=0)
    sglang_args: list[str] = Field(default_factory=list, description="extra flags for sglang.launch_server")
    threads: int = Field(0, ge=0, description="embedded engine: torch intra-op threads (0: torch's default)")


class RolloutConfig(Section):
    mode: Literal["async", "sync"] = Field(
        "async", description="sync: generate a batch, train, push (sets buffer.max_staleness=0)"
    )
    n_samples: int = Field(8, ge=1, description="samples per task (the group size)")
    max_turns: int = Field(4, ge=1)
    max_new_tokens: int = Field(64, ge=1, description="per assistant turn")
    max_total_tokens: int = Field(512, ge=16, description="prompt + all turns")
    temperature: float = Field(
        1.0, gt=0, description="train sampling temperature (groups record it; the trainer divides logits by it)"
    )
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    max_concurrent_groups: int = Field(8, ge=1, description="train groups in flight per server")
    max_concurrent_eval_groups: int = Field(64, ge=1, description="eval groups in flight (usually 1 sample each)")
    tools: Path | None = Field(None, description="tool config YAML; None uses the built-in tools")
    reward: str = Field("gsm8k", description="gsm8k | tool | <module:function>")
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(0, ge=0, le=65535)
    heartbeat_s: float = Field(2.0, gt=0)
    server_id: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]+$", description="consumer name in Redis; None uses <host>-<pid>"
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, in-flight groups get this long to finish, then are handed back"
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="0 disables the metrics server")
    metrics_host: str = Field("127.0.0.1", description="0.0.0.0 in containers, so Prometheus can scrape")


class BufferConfig(Section):
    max_groups: int = Field(256, ge=1, description="bound on unconsumed groups; producers wait beyond it")
    max_staleness: int = Field(
        2, ge=0, description="AReaL's η: groups may be this many versions old (admission bound and trainer filter)"
    )
    groups_per_step: int = Field(8, ge=1, description="groups in one trainer step")
    push_every: int = Field(
        1, ge=1, description="trainer steps per policy version: the trainer pushes every k steps, so a version "
        "spans push_every × groups_per_step groups (the unit of staleness admission)"
    )
    claim_idle_ms: int = Field(30_000, ge=100, description="pending entries idle this long are reclaimed")
    max_attempts: int = Field(3, ge=1, description="deliveries of a task before it is dead-lettered")
    dedup_window: int = Field(
        100_000, ge=1, description="consumed train group ids remembered (groups:state) to drop late duplicate "
        "writes; older ones are forgotten, which bounds the hash"
    )


class TrainerConfig(Section):
    total_steps: int = Field(100, ge=1)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(1.0, gt=0)
    loss: Literal["decoupled_ppo", "tis", "icepop", "ppo"] = Field(
        "decoupled_ppo", description="with ppo_minibatches=1 decoupled_ppo runs as IS-weighted REINFORCE (see README)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = Field(None, gt=0, description="asymmetric upper clip; None uses clip_eps")
    is_cap: float | None = Field(5.0, gt=0, description="decoupled_ppo/tis: cap on the IS weight π_prox/π_behav")
    is_cap_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="above is_cap: truncate the weight to is_cap, or mask the token (weight 0, as AReaL)"
    )
    is_low: float = Field(0.5, ge=0, description="icepop: mask tokens whose ratio is below")
    is_high: float = Field(2.0, gt=0, description="icepop: mask tokens whose ratio is above")
    advantage: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    std_norm: bool = True
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low-var-kl"] = "low-var-kl"
    entropy_coef: float = Field(0.0, ge=0)
    micro_batch_tokens: int = Field(4096, ge=16)
    ppo_minibatches: int = Field(
        1, ge=1, description="optimizer updates per step; 1: π_prox is the step's own forward, so u ≡ 1 and "
        "clip_eps never acts; >1 recomputes π_prox and the later minibatches are clipped against it"
    )
    take_timeout_s: float = Field(5.0, gt=0, description="how long one buffer read blocks waiting for data")
    stop_when_drained: bool = Field(
        False, description="finite data: when no train task or group is left, train the last partial batch and stop"
    )
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = Field(0, ge=0, description="torch intra-op threads per rank (0: torch's default)")
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_host: str = Field("127.0.0.1", description="0.0.0.0 in containers, so Prometheus can scrape")

    @model_validator(mode="after")
    def _icepop_window(self) -> TrainerConfig:
        if self.is_low >= self.is_high:
            raise ValueError("is_low must be below is_high")
        return self


class CheckpointConfig(Section):
    token: str = Field("rollwave-dev-token", min_length=1, description="shared token in gRPC metadata")
    stage_dir: Path = Field(Path("/dev/shm/rollwave"), description="staging area (tmpfs)")
    chunk_bytes: int = Field(1 << 20, ge=4096, le=16 << 20)
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(2, ge=0)


class ApiConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    token: str | None = Field(None, description="bearer token; None disables auth")


class Config(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    redis: RedisConfig = RedisConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    api: ApiConfig = ApiConfig()

    @model_validator(mode="after")
    def _sync_mode(self) -> Config:
        """``rollout.mode=sync`` is the async machinery with max_staleness = 0: a batch is generated only for the
        current version, so generation waits for each push and training waits for each batch."""
        if self.rollout.mode == "sync" and self.buffer.max_staleness != 0:
            self.buffer.max_staleness = 0
        return self


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` with the value read as YAML (so numbers, bools and lists work)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from exc
    return key, value


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        got = "" if err["type"] == "extra_forbidden" else f" (got {err.get('input')!r})"
        lines.append(f"{key}: {msg}{got}")
    return f"invalid config{source}:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults < YAML file < ``key=value`` overrides, validated as one tree."""
    tree: dict[str, Any] = {}
    source = ""
    if path is not None:
        path = Path(path)
        source = f" from {path}"
        try:
            loaded = yaml.safe_load(path.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None


def load_config_or_exit(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """``load_config`` for a command line: a bad config is one line on stderr naming the key, and exit 2."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
