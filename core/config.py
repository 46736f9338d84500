"""The run configuration: one YAML file, one tree of small models, one per component.

Layering is defaults < file < dotted command-line overrides (``trainer.lr=1e-5``). Unknown keys, wrong
types and bad values are errors naming the full dotted key.

Secrets (``SECRETS``: the API token, the checkpoint token, the engine API key) have no defaults. Each
is read from the config, else from ``<key>_file``, else from its environment variable; a dumped config
masks them (``MASK``), and a masked value read back means "take it from the file or the environment".
Launchers hand secrets to components in the environment, never on a command line. Which component needs
which secret is checked when that component starts (``require_secret``), not here: the trainer never
needs the API token.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs, urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from core.rewards import BUILTIN as BUILTIN_REWARDS
from core.rewards import IMPORT_PATH, REWARD_NAME, REWARD_TIMEOUT_S
from core.text_files import TextFileError, line_of, load_yaml, read_text, yaml_key_lines

MIN_SECRET_CHARS = 32
MASK = "**********"  # how pydantic prints a SecretStr, and so how dump_config writes one
# dotted key -> the environment variable it is read from when neither the key nor <key>_file is set
SECRETS: dict[str, str] = {
    "api.token": "ROLLWAVE_API_TOKEN",
    "checkpoint.token": "ROLLWAVE_CHECKPOINT_TOKEN",
    "engine.api_key": "ROLLWAVE_ENGINE_API_KEY",
    "redis.password": "ROLLWAVE_REDIS_PASSWORD",
}
TRAINER_CERT_NAME = "rollwave-trainer"  # the trainers' checkpoint certificate that rollwave up, compose and Helm make
GENERATE_HINT = "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def _usable_secret(secret: SecretStr) -> SecretStr:
    """Long enough, and sendable: each secret travels in an HTTP header or gRPC metadata (a Redis password in the
    ACL file's line), which no line break or control character can."""
    value = secret.get_secret_value()
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"must be at least {MIN_SECRET_CHARS} characters ({GENERATE_HINT})")
    if any(c < " " or c == "\x7f" for c in value):
        raise ValueError("holds a line break or a control character, which no HTTP header or gRPC metadata carries")
    return secret


Secret = Annotated[SecretStr, AfterValidator(_usable_secret)]


class ConfigError(ValueError):
    """A config that cannot be used; the message names the full dotted key."""


class CrossKeyError(ValueError):
    """A check across sections that is about one key, ``key`` (dotted): the error is put at that key, so that it
    names the key's line of the file (a check of the whole config has no line of its own)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class Section(BaseModel):
    # no .inf or .nan: an infinite learning rate or coefficient poisons every weight, an infinite timeout overflows
    # the socket's (redis.timeout_s) or gRPC's deadline at its first use, far from the key. A section given to a
    # config is copied (revalidated): the checks across sections set keys on the config's own copy, never the caller's.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              revalidate_instances="always")


class RunConfig(Section):
    name: str = Field(
        "demo", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",  # not . or ..: it names runs/<name> and staging dirs
        description="run id; Redis prefix rw:<name>:",
    )
    dir: Path = Field(Path("runs"), description="parent of the run directory runs/<name>/")
    seed: int = 0

    @property
    def path(self) -> Path:
        return self.dir / self.name


# SGLang's "whole vocabulary" (its TOP_K_ALL, what top_k -1 becomes): no vocabulary is larger, so a larger top_k
# means the same, and one past an int64 cannot go into the engines' batch tensors (the whole batch fails)
TOP_K_ALL = 1 << 30
# below this both engines sample greedily (SGLang's _SAMPLING_EPS; the embedded engine's sampling.py uses it)
GREEDY_TEMPERATURE = 1e-6


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float = 0.0, where: str = "") -> None:
    """SGLang's sampling checks (``srt/sampling/sampling_params.py``): a value SGLang would refuse fails every
    episode, so it is refused here first; so is a top_k past ``TOP_K_ALL``, which would fail the engine's whole
    batch. ``where`` prefixes the key in the message."""
    if temperature < 0:
        raise ValueError(f"{where}temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{where}top_p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"{where}min_p must be in [0, 1], got {min_p}")
    if top_k < 1 and top_k != -1:
        raise ValueError(f"{where}top_k must be -1 (disable), or at least 1, got {top_k}")
    if top_k > TOP_K_ALL:
        raise ValueError(f"{where}top_k must be at most 2**30 = {TOP_K_ALL} (the whole vocabulary, as -1), "
                         f"got {top_k}")


def check_train_temperature(temperature: float, where: str = "") -> None:
    """A temperature groups are trained at: below ``GREEDY_TEMPERATURE`` the engines sample greedily (every sample
    of a task the same, and its logprobs not of the distribution the trainer computes), while the trainer divides
    the logits by it. ``where`` prefixes the message (the key, where the error's location does not name it)."""
    if not temperature >= GREEDY_TEMPERATURE:  # NaN too
        raise ValueError(f"{where}{temperature:g} cannot be trained on: below {GREEDY_TEMPERATURE:g} the engines "
                         "sample greedily (every sample of a task the same, no sampled logprobs) while the trainer "
                         f"divides the logits by it; use >= {GREEDY_TEMPERATURE:g} (greedy is for eval jobs)")


class LoraConfig(Section):
    """LoRA on the policy (peft): the trainer trains only the adapter and pushes only its tensors."""

    rank: int = Field(8, ge=1, le=1024, description="adapter rank r")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / rank) * B @ A")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="names (suffixes) of the Linear modules that get an adapter",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input in the training forward; above 0 the step "
        "computes π_prox in a no-grad pass (the adapter without dropout, as served) even with ppo_minibatches=1"
    )
    name: str = Field("policy", pattern=r"^[A-Za-z0-9_.-]+$",
                      description="the adapter's name on the engines (SGLang's lora_name; requests name it)")


class ModelConfig(Section):
    path: Path = Field(Path("runs/model"), description="HF model directory (built by `rollwave model init`)")
    init_if_missing: bool = Field(
        False, description="build the tiny model at `path` when it does not exist (the demo); off: a missing "
        "model is an error naming model.path"
    )
    seed: int = 0
    lora: LoraConfig | None = Field(None, description="train a LoRA adapter instead of every weight (null: off)")


def check_redis_url(url: str) -> str:
    """A Redis URL with no password in it: a URL lands on command lines, in logs and in dumped configs, which
    ``redis.password`` never does."""
    parts = urlsplit(url)
    # redis-py also takes ?password= (over the user info), so a query can carry one too
    if parts.password is not None or "password" in parse_qs(parts.query):
        raise ValueError("carries a password: give it in redis.password (env ROLLWAVE_REDIS_PASSWORD, or "
                         "redis.password_file) and leave it out of the URL")
    return url


def check_engine_url(url: str) -> str:
    """An engine base URL, ``http(s)://host[:port]``, without credentials: a URL lands on command lines, in logs
    and in dumped configs, which ``engine.api_key`` never does. One without a scheme, or with a path (the OpenAI API's
    ``/v1``: the engine's routes are at its root), would be polled until ``engine.ready_timeout_s`` (an hour by
    default), then blamed on that key."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:  # not echoed: it would show them
        raise ValueError("an engine URL carries credentials: give the engine's key in engine.api_key (env "
                         "ROLLWAVE_ENGINE_API_KEY, or engine.api_key_file) and leave them out of the URL")
    try:  # urlsplit checks the port when asked: ValueError past 65535
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.path not in ("", "/") \
            or parts.query or parts.fragment or any(c.isspace() for c in url):
        raise ValueError(f"{url} is not an engine URL: want http(s)://host:port, e.g. http://127.0.0.1:30000 (no "
                         "path: the engine's routes are at its root)")
    return url


def _engine_address(url: str) -> tuple[str, str, int]:
    """What names one engine: its scheme, host and port (the default one when the URL gives none)."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


class RedisConfig(Section):
    url: str | None = Field(None, description="external Redis; None starts the embedded redis-server")
    username: str | None = Field(None, description="Redis ACL user to log in as with redis.password (None or "
                                 "empty: the default user)")
    password: Secret | None = Field(
        None, description="Redis password (AUTH; the embedded server requires it when set); env ROLLWAVE_REDIS_PASSWORD"
    )
    password_file: Path | None = Field(None, description="file holding redis.password")
    data_dir: Path | None = Field(None, description="embedded Redis data dir (default: <run dir>/redis)")
    aof: bool = Field(True, description="append-only file on the embedded Redis")
    unix_socket: bool = Field(False, description="embedded Redis listens on a unix socket instead of TCP")
    port: int = Field(0, ge=0, le=65535, description="embedded Redis TCP port; 0 picks a free one")
    appendfsync: Literal["always", "everysec"] = Field(
        "everysec", description="embedded Redis AOF fsync: always (no acknowledged write lost) or everysec"
    )
    timeout_s: float = Field(
        5.0, gt=1.0, description="seconds a Redis connect or reply may take before it is an error naming the "
        "server (each retry of the outage policy waits as long); above the 1 s that blocking reads wait"
    )

    @field_validator("url")
    @classmethod
    def _no_password_in_url(cls, url: str | None) -> str | None:
        return url if url is None else check_redis_url(url)


class EngineConfig(Section):
    backend: Literal["embedded", "sglang"] = "embedded"
    urls: list[str] = Field(default_factory=list, description="engine base URLs to use instead of starting one")
    host: str = Field("127.0.0.1", description="embedded engine bind address; not loopback needs engine.api_key")
    api_key: Secret | None = Field(
        None, description="bearer key of the engines (SGLang --api-key); env ROLLWAVE_ENGINE_API_KEY"
    )
    api_key_file: Path | None = Field(None, description="file holding engine.api_key")
    port: int = Field(0, ge=0, le=65535, description="embedded engine; 0 picks a free port (published in the registry)")
    max_batch_size: int = Field(64, ge=1)
    max_context: int = Field(1024, ge=16, description="prompt + generation tokens per request")
    prefix_cache_tokens: int = Field(
        16384, ge=0, description="embedded engine: tokens of finished requests' KV kept for the requests that "
        "extend them (a multi-turn episode's next turn), as SGLang's radix cache; 0 turns it off"
    )
    admit_wait_ms: float = Field(
        100.0, ge=0, le=10_000, description="embedded engine: while requests decode, a new one waits up to this long "
        "to be prefilled together with later arrivals, unless the waiting ones would fill the batch (fewer, larger "
        "prefills between decode steps: +20% async throughput in bench/e2e.py for up to this much more latency per "
        "turn); 0: each is admitted at the next step"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="how long the rollout server waits on one engine call (the connect, and each read "
        "of the answer) before it fails with an EngineError naming the engine and the call"
    )
    threads: int = Field(0, ge=0, description="embedded engine: torch intra-op threads (0: torch's default)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="embedded engine: dtype of the served weights (auto: the checkpoint's, as SGLang)"
    )
    ready_timeout_s: float = Field(
        3600.0, gt=0, description="how long the rollout server waits for its engines' /health (a 70B load "
        "from network storage takes tens of minutes); progress is logged meanwhile"
    )

    @field_validator("urls")
    @classmethod
    def _engine_urls(cls, urls: list[str]) -> list[str]:
        """Each engine once: a second URL of it would take a second share of the requests and of every weight push."""
        first: dict[tuple[str, str, int], int] = {}
        for i, url in enumerate(urls):
            if (j := first.setdefault(_engine_address(check_engine_url(url)), i)) != i:
                raise ValueError(f"{urls[j]!r} and {url!r} are one engine: list each engine once")
        return urls


class RolloutConfig(Section):
    mode: Literal["async", "sync"] = Field(
        "async", description="sync: generate a batch, train, push (sets buffer.max_staleness=0)"
    )
    n_samples: int = Field(8, ge=1, description="samples per task (the group size)")
    max_turns: int = Field(4, ge=1)
    max_new_tokens: int = Field(64, ge=1, description="per assistant turn")
    max_total_tokens: int = Field(512, ge=16, description="prompt + all turns")
    temperature: float = Field(
        1.0, description="train sampling temperature (groups record it; the trainer divides logits by it): at least "
        "1e-6, below which the engines sample greedily"
    )
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 (the whole vocabulary) or 1 .. 2**30, as SGLang requires")
    max_concurrent_groups: int = Field(8, ge=1, description="train groups in flight per server")
    max_concurrent_eval_groups: int = Field(64, ge=1, description="eval groups in flight (usually 1 sample each)")
    tools: Path | None = Field(None, description="tool config YAML; None uses the built-in tools")
    reward: str = Field("gsm8k", description="a built-in (gsm8k, tool, tool_last) or a reward_allowlist name")
    reward_allowlist: dict[str, str] = Field(
        default_factory=dict,
        description="custom reward functions the operator allows, name -> module:function; jobs pick them by name",
    )
    reward_timeout_s: float = Field(
        REWARD_TIMEOUT_S, gt=0, description="how long one reward function may take; past it, it is cancelled and "
        "the episode fails (reward_error, naming the reward and the task), so its group is rolled out again"
    )
    tool_timeout_s: float = Field(
        60.0, gt=0, description="how long a tool's create, call or release may take before it is cancelled: a "
        "call's error is the model's tool answer (counted as outcome timeout), a create's fails the episode"
    )
    grpc_host: str = "127.0.0.1"
    grpc_port: int = Field(0, ge=0, le=65535, description="checkpoint receiver; 0 picks a free port (published)")
    stage_port: int = Field(
        0, ge=0, le=65535, description="checkpoint receiver, on grpc_host: takes a Stage's bytes over plain TCP (TLS "
        "when the checkpoint plane is), each connection admitted by the one-time ticket its Stage call carried; "
        "0 picks a free port (told to pushers in Status)"
    )
    heartbeat_s: float = Field(2.0, gt=0)
    server_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",  # not . or ..: it names a directory under checkpoint.stage_dir
        description="consumer name in Redis; None uses <host>-<pid>",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on SIGTERM, in-flight groups get this long to finish, then are handed back"
    )
    metrics_port: int | None = Field(
        0, ge=0, le=65535, description="0 picks a free port (published in the registry); null: no metrics server"
    )
    metrics_host: str = Field("127.0.0.1", description="0.0.0.0 in containers, so Prometheus can scrape")
    openai_host: str = Field("127.0.0.1", description="the OpenAI-compatible episode endpoint's address")
    openai_port: int = Field(0, ge=0, le=65535, description="its port; 0 picks a free one (published in the registry)")
    openai_model: str = Field("rollwave", min_length=1, description="the model name agents must send")
    agent_allowlist: list[str] = Field(
        default_factory=list, description="module:function agent entrypoints jobs may name (operator-chosen)"
    )
    agent_timeout_s: float = Field(300.0, gt=0, description="wall-clock limit of one agent run")
    agent_memory_mb: int = Field(2048, ge=64, description="address-space limit (RLIMIT_AS) of one agent process")
    agent_max_processes: int | None = Field(
        256, ge=2, description="processes and threads one agent run may have at once (RLIMIT_NPROC, counted in a user "
        "namespace of the run's own): a fork past it fails, so a fork bomb stops there; null: no limit, for hosts "
        "without user namespaces, where a run with a limit fails"
    )

    @field_validator("reward_allowlist")
    @classmethod
    def _allowlist(cls, allowlist: dict[str, str]) -> dict[str, str]:
        for name, path in allowlist.items():
            if not REWARD_NAME.fullmatch(name) or name in BUILTIN_REWARDS:
                builtins = ", ".join(BUILTIN_REWARDS)
                raise ValueError(f"{name!r}: a name must be an identifier and not a built-in ({builtins})")
            if not IMPORT_PATH.fullmatch(path):
                raise ValueError(f"{name}: {path!r} is not module:function")
        return allowlist

    @field_validator("agent_allowlist")
    @classmethod
    def _agent_entrypoints(cls, allowlist: list[str]) -> list[str]:
        """Each entry as jobs name it: one that is not ``module:function`` would refuse every job's sample instead."""
        for entry in allowlist:
            if not IMPORT_PATH.fullmatch(entry):
                raise ValueError(f"{entry!r} is not module:function")
        return allowlist

    @model_validator(mode="after")
    def _known_reward(self) -> RolloutConfig:
        if self.reward not in BUILTIN_REWARDS and self.reward not in self.reward_allowlist:
            raise ValueError(
                f"reward {self.reward!r} is not a built-in ({', '.join(BUILTIN_REWARDS)}) "
                "nor a name in rollout.reward_allowlist"
            )
        return self

    @field_validator("temperature")
    @classmethod
    def _trainable_temperature(cls, temperature: float) -> float:
        check_train_temperature(temperature)
        return temperature

    @model_validator(mode="after")
    def _sampling(self) -> RolloutConfig:
        check_sampling(self.temperature, self.top_p, self.top_k)
        return self


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
    claim_idle_ms: int = Field(30_000, ge=100, description="pending entries idle this long are reclaimed; also the "
                               "TTL of the trainer's lease (a job's delete takes a lapsed trainer's groups)")
    max_attempts: int = Field(3, ge=1, description="deliveries of a task before it is dead-lettered")
    filter_degenerate_groups: bool = Field(
        False, description="DAPO dynamic sampling, for the group-relative estimators (trainer.advantage grpo, rloo, "
        "reinforce_pp; refused with gae, whose critic baseline still trains such groups): the trainer drops groups "
        "whose rewards are all equal (no group-relative signal) and keeps taking until a step holds "
        "groups_per_step informative ones"
    )
    dedup_window: int = Field(
        100_000, ge=1, description="consumed train group ids and written eval group ids remembered (groups:state) "
        "to drop late duplicate writes; older ones are forgotten, which bounds the hash"
    )


class CriticConfig(Section):
    """The value model of ``trainer.advantage=gae``; ignored by the group-relative estimators."""

    path: Path | None = Field(
        None, description="HF model to start the value model from (a scalar head is added if it has none); "
        "None: the policy's weights with a new head"
    )
    lr: float = Field(1e-4, gt=0, description="the critic's own AdamW learning rate (constant)")
    value_clip: float | None = Field(
        0.5, gt=0, description="ε of the clipped value loss around the step's old values; None: unclipped"
    )
    warmup_steps: int = Field(0, ge=0, description="the first steps train the critic only (the policy stays)")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount γ per generated token")
    lam: float = Field(1.0, ge=0, le=1, description="GAE λ (1: Monte Carlo returns minus the value)")


class OverlongConfig(Section):
    """Samples cut off by a token limit (finish_reason ``length`` or ``max_total_tokens``), DAPO arXiv 2503.14476."""

    mode: Literal["off", "penalty", "mask"] = Field(
        "off", description="penalty: DAPO's soft over-long punishment added to the reward; mask: truncated "
        "samples are left out of the loss (DAPO's over-long filtering)"
    )
    max_tokens: int | None = Field(
        None, ge=1, description="penalty: L_max, generated tokens at which the penalty reaches -penalty_factor"
    )
    buffer_tokens: int = Field(
        16, ge=1, description="penalty: L_cache, the penalty grows linearly over the last L_cache tokens before L_max"
    )
    penalty_factor: float = Field(1.0, ge=0, description="penalty: the largest penalty")

    @model_validator(mode="after")
    def _penalty_lengths(self) -> OverlongConfig:
        if self.mode == "penalty":
            if self.max_tokens is None:
                raise ValueError("mode penalty needs max_tokens (L_max)")
            if self.buffer_tokens > self.max_tokens:
                raise ValueError("buffer_tokens (L_cache) must not exceed max_tokens (L_max)")
        return self


Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW moment decay (torch.optim.AdamW's own bounds)
TrainerOffload = Literal["auto", "memory_saver", "cpu", "none"]  # trainer.offload; trainer/offload.py


class TrainerConfig(Section):
    total_steps: int = Field(100, ge=1)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999), description="AdamW's β1, β2, each in [0, 1): torch refuses others at the trainer's start, and a "
        "resume sets them on the restored optimizer unchecked (β2 >= 1 makes every update NaN)"
    )
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
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo", description="gae: PPO with a critic (trainer.critic); the others use the group as baseline"
    )
    std_norm: bool = Field(
        True, description="grpo: divide each group's centred rewards by their std (false: Dr. GRPO, centred "
        "only); the other advantages have no such choice"
    )
    critic: CriticConfig = CriticConfig()
    overlong: OverlongConfig = OverlongConfig()
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low-var-kl"] = "low-var-kl"
    entropy_coef: float = Field(0.0, ge=0)
    micro_batch_tokens: int = Field(4096, ge=16)
    share_prefix: bool = Field(
        True, description="run the prompt a group's samples share once per micro-batch, its KV reused by each "
        "sample: the same loss and gradients as a forward per sample, for fewer tokens; FSDP then holds the "
        "layers unsharded through each update (false where one unsharded copy of the model does not fit)"
    )
    ppo_minibatches: int = Field(
        1, ge=1, description="optimizer updates per step (one per sample in a step with fewer samples); 1: π_prox "
        "is the step's own forward, so u ≡ 1 and clip_eps never acts (with model.lora.dropout > 0 a no-grad pass "
        "computes π_prox, and u is the dropout's noise); >1 recomputes π_prox and the later minibatches are clipped "
        "against it"
    )
    take_timeout_s: float = Field(5.0, gt=0, description="how long one buffer read blocks waiting for data")
    stop_when_drained: bool = Field(
        False, description="finite data: when no train task or group is left, train the last partial batch and stop"
    )
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    offload: TrainerOffload = Field(
        "auto", description="placement.mode=colocated (turns, not the overlap): how the trainer gives the device "
        "back between steps. memory_saver: its parameters and optimizer state live in a torch-memory-saver region, "
        "paused to pinned host memory and resumed in place (CUDA, the torch-memory-saver package); cpu: they move "
        "to host memory and back; none: they stay (the engines get what is left). auto: memory_saver where "
        "installed, else cpu; on a CPU device nothing moves"
    )
    dist_timeout_s: float = Field(
        1800.0, gt=0, description="several ranks: how long the rendezvous waits for every rank, and a collective "
        "for the slowest one, before it is an error naming the pool's address (torch's gloo default)"
    )
    threads: int = Field(0, ge=0, description="torch intra-op threads per rank (0: torch's default)")
    metrics_port: int | None = Field(
        0, ge=0, le=65535, description="rank 0; 0 picks a free port (published in the trainer status); null: none"
    )
    metrics_host: str = Field("127.0.0.1", description="0.0.0.0 in containers, so Prometheus can scrape")

    @model_validator(mode="after")
    def _icepop_window(self) -> TrainerConfig:
        if self.is_low >= self.is_high:
            raise ValueError("is_low must be below is_high")
        return self

    @model_validator(mode="after")
    def _std_norm_is_grpo_only(self) -> TrainerConfig:
        if not self.std_norm and self.advantage != "grpo":  # else a setting silently without effect
            raise ValueError(f"std_norm=false applies to advantage=grpo only, not {self.advantage}")
        return self

    @model_validator(mode="after")
    def _warmups_end_within_the_run(self) -> TrainerConfig:
        """Under gae the first critic.warmup_steps train the critic alone; the cosine schedule spans the policy's
        steps (trainer/optim.py): a warm-up that lasts the whole run would never let the policy train, or the
        learning rate finish warming up (its decay never starts)."""
        critic = self.critic.warmup_steps if self.advantage == "gae" else 0
        if critic >= self.total_steps:
            raise ValueError(f"critic.warmup_steps ({critic}) must be below total_steps ({self.total_steps}) with "
                             "advantage=gae: those steps train the critic alone, so the policy would never train")
        if self.lr_schedule == "cosine" and self.warmup_steps >= self.total_steps - critic:
            steps = f"total_steps ({self.total_steps})" + (f" less critic.warmup_steps ({critic})" if critic else "")
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be below {steps} with lr_schedule=cosine: "
                             "the learning rate would never finish warming up, nor its cosine decay start")
        return self


class CheckpointConfig(Section):
    token: Secret | None = Field(
        None, description="bearer token of the checkpoint plane (gRPC metadata); env ROLLWAVE_CHECKPOINT_TOKEN"
    )
    token_file: Path | None = Field(None, description="file holding checkpoint.token")
    stage_dir: Path = Field(Path("/dev/shm/rollwave"), description="staging area (tmpfs)")
    chunk_bytes: int = Field(1 << 20, ge=4096, le=16 << 20)
    stage_transport: Literal["tcp", "grpc"] = Field(
        "tcp", description="pusher: how a Stage's bytes travel: tcp (the server's stage port: one kernel copy per "
        "side, 1.5-2x a gRPC stream's throughput here; bench/checkpoint.py) or grpc (in the Stage stream itself, "
        "chunk_bytes per message: one port per server, for networks that pass only gRPC)"
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="deadline for a server's gRPC connection to be ready")
    stage_timeout_s: float = Field(
        10.0, gt=0, description="fixed part of a Stage's deadline; the deadline adds bytes / min_throughput_mib_s"
    )
    min_throughput_mib_s: float = Field(
        50.0, gt=0, description="a server that stages slower than this misses its Stage deadline (a straggler)"
    )
    commit_timeout_s: float = Field(300.0, gt=0, description="deadline of a Commit: pause, load, continue")
    pause_timeout_s: float = Field(
        60.0, gt=0, description="receiver: deadline for the engine to pause (and to continue) around a load"
    )
    kv_on_swap: Literal["recompute", "keep"] = Field(
        "recompute", description="receiver: the KV of the requests running at a swap: recompute (pause retract: "
        "dropped and prefilled again under the new weights, so each token's logprob is the policy recorded for it) "
        "or keep (pause in_place: they go on from the old weights' KV with no re-prefill, a shorter stall; the "
        "tokens after the swap are sampled from new weights over an old prefix, which importance correction sees; "
        "the load does not flush the engine's prefix cache either, so later turns also start from old-weight KV)"
    )
    prepare_weights: bool = Field(
        True, description="receiver: before the pause, have the engine read the staged version into a spare copy of "
        "its weights, so the load in the pause swaps pointers (the embedded engine; one more copy of the weights in "
        "its memory). false: the load reads and copies the weights inside the pause, and no spare is held"
    )
    prefill_ahead: bool = Field(
        True, description="receiver, with prepare_weights and kv_on_swap recompute: the prepare also has the engine "
        "compute the running requests' KV under the new weights, while it generates (a prompt they share once), so "
        "after the swap they prefill only the tokens since: the stall a request sees drops to about one decode "
        "step, and the prefill is moved, not added (bench/e2e.py --compare ahead). false: they are prefilled again "
        "after the swap, inside the stall"
    )
    empty_cache_on_resume: bool = Field(
        False, description="receiver: let continue_generation empty the CUDA cache (SGLang's torch_empty_cache)"
    )
    retries: int = Field(2, ge=0, description="more tries of a Stage refused as unavailable, or of a failed Commit")
    max_version_jump: int = Field(
        1_000_000, ge=1, description="a receiver refuses a version more than this far above the one it serves, "
        "so no token holder can stage a version near 2^63 and leave the trainer no higher one"
    )
    tls_cert: Path | None = Field(
        None, description="PEM certificate this component presents on the checkpoint plane (receiver or pusher)"
    )
    tls_key: Path | None = Field(None, description="PEM private key of tls_cert")
    tls_ca: Path | None = Field(
        None, description="PEM CA that signs the peers' certificates; with tls_cert and tls_key set, the "
        "checkpoint plane is mutual TLS (unset: plaintext gRPC, still with the token and the servers' proof)"
    )
    tls_server_name: str | None = Field(
        None, description="pusher: the DNS name every receiver's certificate must carry, checked instead of the "
        "host it dials (for receivers that advertise an IP address, as pods do); unset: that host"
    )
    tls_client_name: str | None = Field(
        TRAINER_CERT_NAME, description="receiver, with TLS: the name (common name or DNS name) the pusher's "
        "certificate must carry, or every call is refused (PERMISSION_DENIED), so no other certificate the CA signed "
        "(a receiver's own, which Helm's allow to dial) can stage weights; null: any certificate tls_ca signed"
    )
    quorum: int | Literal["majority", "all"] = Field(
        "majority",
        description="servers that must commit a version before it is published (rw:<run>:version, admission): "
        "majority of the live servers (1 when there is one), all of them, or a number",
    )

    @model_validator(mode="after")
    def _positive_quorum(self) -> CheckpointConfig:
        if isinstance(self.quorum, int) and self.quorum < 1:
            raise ValueError("quorum must be majority, all or a number >= 1")
        return self

    @model_validator(mode="after")
    def _tls_all_or_none(self) -> CheckpointConfig:
        given = [f for f in ("tls_cert", "tls_key", "tls_ca") if getattr(self, f) is not None]
        if given and len(given) < 3:
            raise ValueError(f"TLS needs tls_cert, tls_key and tls_ca together; only {', '.join(given)} set")
        if self.tls_server_name is not None and not given:
            raise ValueError("tls_server_name needs TLS (tls_cert, tls_key and tls_ca)")
        return self

    @property
    def swap_pause(self) -> str:
        """The engine's pause mode around a weight load, as ``kv_on_swap`` asks."""
        return "in_place" if self.kv_on_swap == "keep" else "retract"


class PlacementConfig(Section):
    """Where the parts run. ``mode``: ``decoupled`` (engines and trainer on their own devices, weights pushed over
    gRPC) or ``colocated`` (one device for both, in turns: ``buffer.colocation``). CPU sets per component, the CPU
    analogue of GPU placement: each process pins itself at start (``os.sched_setaffinity``) and, unless its
    ``threads`` is set, runs as many torch threads as CPUs."""

    mode: Literal["decoupled", "colocated"] = Field(
        "decoupled", description="colocated: the engines and the trainer share the device and take turns"
    )
    colocated_staleness: int = Field(
        0, ge=0, le=1, description="colocated: 0, the engines release their memory while the trainer trains; 1, they "
        "keep it and generate the next batch on the previous weights meanwhile (a one-step overlap, for a device "
        "that holds both), loading each new version between batches",
    )
    colocated_timeout_s: float = Field(
        600.0, gt=0, description="colocated: how long the trainer waits for the servers to release the device "
        "(an error naming them), and how long a released server waits before warning",
    )

    rollout_cpus: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="CPU ids of each rollout server and its embedded engine (empty: not pinned)"
    )
    trainer_cpus: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="CPU ids of the trainer's ranks (empty: not pinned)"
    )
    agent_cpus: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="CPU ids of the processes that run agent jobs' agents, each pinned as it "
        "starts (empty: the rollout server's). An agent is CPU work beside the engine's: on a CPU host, let it "
        "use cores beyond the engine's"
    )


# an api.allowed_hosts entry: *, a host name or IPv4 address (*. for any subdomain), or an IPv6 address (a Ray node's
# comes unbracketed)
HOST_PATTERN = re.compile(r"\*|(\*\.)?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*|\[?[0-9A-Fa-f.]*(:[0-9A-Fa-f.]*){2,}]?")


class ApiConfig(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port (published in Redis)")
    token: Secret | None = Field(
        None, description="bearer token (env ROLLWAVE_API_TOKEN); required unless the API binds loopback"
    )
    token_file: Path | None = Field(None, description="file holding api.token")
    allowed_hosts: list[str] = Field(
        ["127.0.0.1", "localhost", "[::1]"],
        min_length=1,
        description="Host headers the API answers (DNS rebinding guard); *.example.com wildcards work",
    )
    data_root: Path = Field(Path("data"), description="source.path of a job must lie under this directory")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="larger request bodies are refused (413)")
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request body not all received this long after it is first read is refused (408)"
    )
    max_job_tasks: int = Field(100_000, ge=1, description="tasks in one job, inline or loaded")

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, hosts: list[str]) -> list[str]:
        """Each entry as Starlette's TrustedHostMiddleware matches it (against the Host header's host, without its
        port): an entry with a scheme, a port or a path never matched (every request 400), and a wildcard other
        than a leading ``*.`` failed its assertion, which the API's guard meets on every request (500)."""
        for host in hosts:
            if not HOST_PATTERN.fullmatch(host):
                raise ValueError(f"{host!r} cannot match a Host header: give a name or address without scheme, port or "
                                 "path (rw.example.com, 10.0.0.5, [::1]), *.example.com for its subdomains, or *")
        return hosts


class LauncherConfig(Section):
    """How long the launchers (``LocalStack``, ``rollwave up``'s actors) go on restarting a component that keeps
    failing: the death that would be restart ``max_restarts + 1`` within ``restart_window_s``, however long each run
    stayed up, is the last: the launcher gives the component up and stops the run (a run without its trainer or a
    rollout server is not the run asked for), as systemd's ``StartLimitBurst`` and Ray's ``max_restarts`` bound
    theirs. And how long they give a trainer rank to stop (``trainer_stop_grace_s``); the other components get what
    ``services.launcher.components`` says, short: nothing of theirs outlasts ``rollout.shutdown_grace_s``."""

    max_restarts: int = Field(
        10, ge=0, description="restarts of a failing component within restart_window_s before the run is stopped "
        "(0: restart it for ever)",
    )
    restart_window_s: float = Field(
        900.0, gt=0, description="the window of max_restarts; the default holds eleven deaths a minute up each (the "
        "backoff starts again from 0.5 s after a run up 60 s), so a component that dies within a minute of every "
        "start is given up however slowly it fails",
    )
    trainer_stop_grace_s: float = Field(
        120.0, gt=0, description="how long a launcher (LocalStack, rollwave up's actors) gives a trainer rank to stop "
        "after its SIGTERM before it SIGKILLs it, saying so: a pool's ranks finish a checkpoint or a push in flight, "
        "record the stop and delete their lease first (an idle one stops within trainer.take_timeout_s); the chart's "
        "trainer.terminationGracePeriodSeconds and compose's stop_grace_period are the same 120 s: set them alike",
    )


class Config(Section):
    _masked_unset: frozenset[str] = PrivateAttr(default=frozenset())  # masked in the file, given nowhere else
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    redis: RedisConfig = RedisConfig()
    engine: EngineConfig = EngineConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    api: ApiConfig = ApiConfig()
    placement: PlacementConfig = PlacementConfig()
    launcher: LauncherConfig = LauncherConfig()

    def masked_unset(self, dotted: str) -> bool:
        """Whether the secret ``dotted`` was masked in the file it was loaded from and given nowhere else."""
        return dotted in self._masked_unset

    @model_validator(mode="after")
    def _sync_mode(self) -> Config:
        """``rollout.mode=sync`` is the async machinery with max_staleness = 0: a batch is generated only for the
        current version, so generation waits for each push and training waits for each batch."""
        if self.rollout.mode == "sync" and self.buffer.max_staleness != 0:
            self.buffer.max_staleness = 0
        return self

    @model_validator(mode="after")
    def _colocated(self) -> Config:
        """Colocated turns are synchronous (each batch is generated by the weights the last training step left), or
        one step behind with the overlap: ``buffer.max_staleness`` is ``placement.colocated_staleness``."""
        if self.placement.mode == "colocated":
            if self.model.lora is not None:
                raise CrossKeyError("model.lora", "placement.mode=colocated: model.lora is not supported (the local "
                                    "push writes full weights); use placement.mode=decoupled")
            if self.rollout.mode == "sync" and self.placement.colocated_staleness:
                raise CrossKeyError("placement.colocated_staleness", "rollout.mode=sync generates each batch with the "
                                    "weights of the step before it; placement.colocated_staleness=1 (the overlap) one "
                                    "step behind: set one or the other")
            if self.placement.colocated_timeout_s <= 3 * self.rollout.heartbeat_s:
                raise CrossKeyError(
                    "placement.colocated_timeout_s", f"placement.colocated_timeout_s "
                    f"({self.placement.colocated_timeout_s:g}) must exceed three rollout.heartbeat_s "
                    f"({3 * self.rollout.heartbeat_s:g} s), how long a dead server stays live: the trainer would fail "
                    "its step waiting for a server that died just before its turn")
            self.buffer.max_staleness = self.placement.colocated_staleness
            if self.trainer.dist_timeout_s <= self.placement.colocated_timeout_s:
                raise CrossKeyError(
                    "trainer.dist_timeout_s", f"trainer.dist_timeout_s ({self.trainer.dist_timeout_s:g}) must exceed "
                    f"placement.colocated_timeout_s ({self.placement.colocated_timeout_s:g}): the other ranks wait "
                    "at a barrier while rank 0 waits for the servers to release")
        return self

    @model_validator(mode="after")
    def _context(self) -> Config:
        """The embedded engine a rollout server starts refuses any request past ``engine.max_context``: an episode
        allowed more would fail as an engine error (retried, then dead-lettered) instead of ending truncated."""
        if self.engine.backend == "embedded" and not self.engine.urls \
                and self.rollout.max_total_tokens > self.engine.max_context:
            raise CrossKeyError(
                "rollout.max_total_tokens", f"rollout.max_total_tokens ({self.rollout.max_total_tokens}) exceeds "
                f"engine.max_context ({self.engine.max_context}): the engine refuses requests past its context, so "
                "long episodes would fail instead of ending max_total_tokens")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling(self) -> Config:
        """Dynamic sampling drops the groups a group-relative baseline gives zero advantage; GAE's baseline is the
        critic, so those groups still carry signal and dropping them would lose data silently."""
        if self.buffer.filter_degenerate_groups and self.trainer.advantage == "gae":
            raise CrossKeyError(
                "buffer.filter_degenerate_groups", "buffer.filter_degenerate_groups needs a group-relative "
                "trainer.advantage (grpo, rloo, reinforce_pp), not gae: with the critic as baseline a group whose "
                "rewards are all equal still has nonzero advantages, and dropping it would lose its data")
        return self

    @model_validator(mode="after")
    def _group_size(self) -> Config:
        """A group-relative baseline is the group's other samples: a group of one has advantage 0 (rloo divides by
        n - 1), so every train group would train on no reward. GAE's baseline is the critic."""
        if self.rollout.n_samples == 1 and self.trainer.advantage != "gae":
            raise CrossKeyError(
                "rollout.n_samples", f"rollout.n_samples=1 with trainer.advantage={self.trainer.advantage}: a group of "
                "1 sample has advantage 0 under a group-relative baseline (the group's other samples), so training "
                "would learn nothing; give rollout.n_samples >= 2, or trainer.advantage=gae")
        return self


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` in ``tree``; a null on the way is an empty section (``model.lora: null``, as a dumped config
    writes it, is LoRA off: ``model.lora.rank=16`` turns it on)."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``a.b=value`` with the value read as YAML (so numbers, bools and lists work); a secret's value is
    taken as written (YAML would cut ``abc #x`` to ``abc``)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value")
    if key in SECRETS:
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from exc
    return key, value


def _format_validation_error(exc: ValidationError, path: Path | None, overridden: list[str]) -> str:
    """One line per error, naming the key and, where the file set it, ``file:line`` (an overridden key's
    value came from the command line, so no line of the file is named for it)."""
    lines = yaml_key_lines(path) if path is not None else {}
    out = []
    for err in exc.errors():
        cause = err.get("ctx", {}).get("error")
        loc = (*err["loc"], *cause.key.split(".")) if isinstance(cause, CrossKeyError) else err["loc"]
        key = ".".join(str(p) for p in loc) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        # never echo a secret: nor a whole section or config (a check across keys), which holds the secrets too
        quiet = err["type"] == "extra_forbidden" or key in SECRETS or key in ("redis.url", "engine.urls") \
            or isinstance(err.get("input"), dict)  # a URL refused for its credentials is not printed either
        got = "" if quiet else f" (got {err.get('input')!r})"
        # a check of a whole section (or config) may be about an overridden key in it: then no line of the file
        from_override = any(f"{key}.".startswith(f"{o}.") or o.startswith(f"{key}.") or key == "<root>"
                            for o in overridden)
        if from_override:
            line = None
        elif isinstance(cause, CrossKeyError):  # its key's own line: none where the key keeps its default
            line = lines.get(tuple(map(str, loc)))
        else:
            line = line_of(lines, loc)
        if key in SECRETS and tuple(key.split(".")) not in lines:  # from its _file or its variable, not this file
            line, msg = None, f"{msg} (given in {key}_file or {SECRETS[key]})"
        out.append(f"{path}:{line}: {key}: {msg}{got}" if line is not None else f"{key}: {msg}{got}")
    source = f" from {path}" if path is not None else ""
    return f"invalid config{source}:\n  " + "\n  ".join(out)


def read_yaml(path: Path, what: str) -> Any:
    """A YAML file's content; ConfigError naming the file (and the line) when it is missing, not UTF-8, not
    YAML or names a key twice (``core.text_files.load_yaml``)."""
    try:
        return load_yaml(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"{what} {path} does not exist") from exc
    except OSError as exc:  # a directory, a file it may not read
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    except TextFileError as exc:
        raise ConfigError(str(exc)) from None


def _a(value: Any) -> str:
    """What a YAML value is, for a message: ``a list``, ``a mapping``, ``a number``."""
    kind = {bool: "boolean", int: "number", float: "number", dict: "mapping", list: "list"}.get(
        type(value), type(value).__name__
    )
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _resolve_secrets(tree: dict[str, Any], env: Mapping[str, str]) -> frozenset[str]:
    """Fill each secret the tree leaves unset (or masked) from ``<key>_file``, else from its environment variable.

    A masked secret with neither stays unset and is returned: a component that needs it refuses to start
    (``require_secret``), one that does not (the API and the checkpoint token) runs."""
    masked: set[str] = set()
    for dotted, var in SECRETS.items():
        section_name, field = dotted.split(".")
        section = tree.get(section_name, {})
        if not isinstance(section, dict):
            continue  # validation names the problem
        value, file = section.get(field), section.get(f"{field}_file")
        if value is not None and value != MASK:
            if file is not None:
                raise ConfigError(f"{dotted}: set {dotted} or {dotted}_file, not both")
            continue
        if file is not None:
            if not isinstance(file, str | os.PathLike):
                raise ConfigError(f"{dotted}_file: expected a path, got {_a(file)}")
            try:
                value = read_text(file).strip()
            except OSError as exc:
                raise ConfigError(f"{dotted}_file: cannot read {file}: {exc.strerror or exc}") from None
            except TextFileError as exc:
                raise ConfigError(f"{dotted}_file: {exc}") from None
        elif env.get(var, "").strip():  # stripped as a file's: a Kubernetes Secret made from a file keeps its newline
            value = env[var].strip()
        elif value == MASK:  # a dumped config: unset here; a component that needs it says where to put it
            value = None
            masked.add(dotted)
        if value is not None or field in section:
            tree[section_name] = {**section, field: value}
    return frozenset(masked)


def require_secret(cfg: Config, dotted: str) -> str:
    """The secret a starting component needs; a ConfigError saying where to put it when it is not set."""
    section, field = dotted.split(".")
    secret = getattr(getattr(cfg, section), field)
    if cfg.masked_unset(dotted):
        raise ConfigError(f"{dotted}: the config holds a masked secret; give it in {SECRETS[dotted]} or {dotted}_file")
    if secret is None:
        raise ConfigError(f"{dotted} is not set: give it in {SECRETS[dotted]} or {dotted}_file ({GENERATE_HINT})")
    return secret.get_secret_value()


def secret_env(cfg: Config, *dotted: str) -> dict[str, str]:
    """The named secrets that are set, as the environment variables a component reads them from."""
    out = {}
    for key in dotted:
        section, field = key.split(".")
        secret = getattr(getattr(cfg, section), field)
        if secret is not None:
            out[SECRETS[key]] = secret.get_secret_value()
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Defaults < YAML file < ``key=value`` overrides, validated as one tree; unset secrets come from their
    ``_file`` or from ``env`` (default ``os.environ``)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        loaded = read_yaml(path, "config file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded
    overridden = []
    for item in overrides or []:
        key, value = parse_override(item)
        _set_dotted(tree, key, value)
        overridden.append(key)
    masked = _resolve_secrets(tree, os.environ if env is None else env)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, path, overridden)) from None
    cfg._masked_unset = masked
    return cfg


CONFIG_ERROR_EXIT = 2  # a component's exit status for a config it cannot start with: restarting cannot help
CONFIG_ACCEPTED_FD_ENV = "ROLLWAVE_CONFIG_ACCEPTED_FD"  # a pipe to a launcher that waits for the config check


def refuse_secret_overrides(overrides: list[str]) -> None:
    """ConfigError for a secret given as a ``key=value`` of a command line, which other users can read
    (``/proc/<pid>/cmdline``, ``ps``): secrets come from the environment or a file."""
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in SECRETS:
            raise ConfigError(f"{key}: never on the command line, where other users can read it: give it in "
                              f"{SECRETS[key]} or {key}_file")


def load_config_or_exit(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    check: Callable[[Config], object] | None = None,
) -> Config:
    """``load_config`` for a command line: a bad config is one line on stderr naming the key, and exit 2; a secret
    among the overrides too. ``check`` adds what the starting component needs (``require_secret``); its
    ConfigError exits the same way. A config that passes is reported to the launcher waiting for it."""
    try:
        refuse_secret_overrides(overrides or [])
        cfg = load_config(path, overrides)
        if check is not None:
            check(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    _tell_launcher_config_accepted()
    return cfg


def _tell_launcher_config_accepted() -> None:
    """Write to the pipe the launcher handed this component (``CONFIG_ACCEPTED_FD_ENV``; the Ray launcher's actors
    do), so that ``rollwave up`` waits for each component's config check and names one that refused its config,
    rather than report a run up that never will be. The pipe is closed here: no child of this process holds it."""
    fd = os.environ.pop(CONFIG_ACCEPTED_FD_ENV, None)
    if fd is not None:
        try:
            os.write(int(fd), b"1")
        except BrokenPipeError:  # the launcher stopped waiting (its timeout, said there): the component goes on
            pass
        finally:
            os.close(int(fd))


def dump_config(cfg: Config) -> str:
    """The config as YAML, secrets masked: safe to print and to write into the run directory."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
