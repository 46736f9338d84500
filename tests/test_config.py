"""Config layering and validation: errors name the full dotted key."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError

from core.config import (
    GREEDY_TEMPERATURE,
    MASK,
    TOP_K_ALL,
    BufferConfig,
    Config,
    ConfigError,
    PlacementConfig,
    RolloutConfig,
    dump_config,
    load_config,
    load_config_or_exit,
    require_secret,
)
from core.jobs import JobSpec
from core.model_dir import ensure_model
from rollout_server.engine.sampling import BatchSampler, SamplingParams
from services.api.app import check_api_config
from services.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_demo_config_loads() -> None:
    cfg = load_config(ROOT / "configs/demo.yaml")
    assert cfg.run.name == "demo"
    assert cfg.trainer.loss == "decoupled_ppo"


def test_layering_defaults_file_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 0.5\n  total_steps: 7\n")
    cfg = load_config(path, ["trainer.lr=1e-5", "rollout.n_samples=3", "engine.urls=[http://a:1]"])
    assert cfg.trainer.lr == 1e-5
    assert cfg.trainer.total_steps == 7
    assert cfg.rollout.n_samples == 3
    assert cfg.engine.urls == ["http://a:1"]
    assert cfg.buffer.max_staleness == 2


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown key"),
        (["trainer.lr=fast"], "trainer.lr:"),
        (["trainer.lr=-1"], "trainer.lr:"),
        (["rollout.mode=sometimes"], "rollout.mode:"),
        (["nosuch.section=1"], "nosuch: unknown key"),
        (["trainer.is_low=3", "trainer.is_high=2"], "trainer:"),
        (['engine.urls=["http://127.0.0.1:30000", "localhost:30000"]'],
         "engine.urls: localhost:30000 is not an engine URL: want http(s)://host:port"),
        (["trainer.advantage=rloo", "trainer.std_norm=false"],
         "trainer: std_norm=false applies to advantage=grpo only, not rloo"),
        (["trainer"], "expected dotted.key=value"),
        (["checkpoint.quorum=0"], "checkpoint: quorum must be majority, all or a number >= 1"),
        (["rollout.top_k=0"], "rollout: top_k must be -1 (disable), or at least 1, got 0"),
        (["rollout.top_p=0"], "rollout.top_p:"),
        (["engine.dtype=int8"], "engine.dtype:"),
        (["engine.ready_timeout_s=0"], "engine.ready_timeout_s:"),
        (["checkpoint.pause_timeout_s=-1"], "checkpoint.pause_timeout_s:"),
        (["checkpoint.quorum=most"], "checkpoint.quorum"),
        (["checkpoint.min_throughput_mib_s=0"], "checkpoint.min_throughput_mib_s:"),
        (["checkpoint.connect_timeout_s=0"], "checkpoint.connect_timeout_s:"),
        (["checkpoint.tls_cert=a.pem", "checkpoint.tls_key=a.key"],
         "checkpoint: TLS needs tls_cert, tls_key and tls_ca together; only tls_cert, tls_key set"),
        (["checkpoint.tls_server_name=rollwave-receiver"], "checkpoint: tls_server_name needs TLS"),
        (["checkpoint.max_version_jump=0"], "checkpoint.max_version_jump:"),
    ],
)
def test_bad_values_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_an_engine_url_with_credentials_is_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ['engine.urls=["http://rollwave:s3cret-key@10.0.0.7:30000"]'])
    assert "engine.urls: an engine URL carries credentials: give the engine's key in engine.api_key" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_bad_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+"):
        load_config(path)


def test_a_bad_value_in_a_file_names_its_line(tmp_path: Path) -> None:
    """Each error names the line of its key (a section's own check the section's line, a list item its line),
    unless an override set the key: then the value is the command line's and no line of the file is named."""
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: x\ntrainer:\n  lr: fast\n  lrr: 1\ncheckpoint:\n  tls_ca: ca.pem\n"
                    "engine:\n  urls:\n    - http://a:1\n    - [1, 2]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()[1:]
    assert sorted(tuple(line.strip().split(": ")[:2]) for line in lines) == [
        (f"{path}:11", "engine.urls.1"), (f"{path}:4", "trainer.lr"), (f"{path}:5", "trainer.lrr"),
        (f"{path}:6", "checkpoint"),
    ]
    with pytest.raises(ConfigError) as err:
        load_config(path, ["trainer.lr=slow", "engine.urls=[http://b:2]", "checkpoint.tls_ca=null"])
    assert sorted(line.strip() for line in str(err.value).splitlines()[1:]) == [
        f"{path}:5: trainer.lrr: unknown key",
        "trainer.lr: Input should be a valid number, unable to parse string as a number (got 'slow')",
    ]


def test_cli_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "-c", str(ROOT / "configs/demo.yaml"), "trainer.lr=2e-5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 2.0e-05" in out
    assert main(["config", "check", "-c", str(ROOT / "configs/demo.yaml"), "api.port=http"]) == 2
    assert "api.port" in capsys.readouterr().err


def test_a_missing_model_is_an_error_naming_model_path(tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.path={tmp_path / 'none'}"])
    with pytest.raises(ConfigError, match=f"model.path: {tmp_path / 'none'} holds no model .* build the tiny model "
                                          f"there \\(`rollwave model init --out {tmp_path / 'none'}`\\)"):
        ensure_model(cfg.model)
    assert not (tmp_path / "none").exists()
    built = ensure_model(load_config(None, [f"model.path={tmp_path / 'tiny'}", "model.init_if_missing=true"]).model)
    assert (built / "config.json").is_file()
    assert load_config(ROOT / "configs/demo.yaml").model.init_if_missing


def test_a_job_refuses_what_sglang_would() -> None:
    source = {"kind": "arith", "limit": 1}
    with pytest.raises(ValidationError, match="top_k must be -1"):
        JobSpec.model_validate({"source": source, "sampling": {"top_k": 0}})
    assert JobSpec.model_validate({"source": source, "sampling": {"top_k": 5}}).sampling.top_k == 5


def test_sync_mode_is_async_with_zero_staleness() -> None:
    assert load_config(None, ["rollout.mode=sync", "buffer.max_staleness=3"]).buffer.max_staleness == 0
    assert load_config(None, ["buffer.max_staleness=3"]).buffer.max_staleness == 3


def test_a_section_built_by_the_caller_is_never_changed_by_the_config_it_goes_into() -> None:
    """The checks across sections set keys (sync mode's and colocation's max_staleness) on the config's own copy of a
    section: one section a caller builds and gives to two configs, sync and async, keeps its value for the second."""
    buffer = BufferConfig(max_staleness=3)
    synced = Config(rollout=RolloutConfig(mode="sync"), buffer=buffer)
    colocated = Config(placement=PlacementConfig(mode="colocated", colocated_staleness=1), buffer=buffer)
    assert (synced.buffer.max_staleness, colocated.buffer.max_staleness) == (0, 1)
    assert buffer.max_staleness == 3 and Config(buffer=buffer).buffer.max_staleness == 3
    config = Config()
    config.buffer = buffer  # an assignment takes a copy too
    config.buffer.max_staleness = 5
    assert buffer.max_staleness == 3


def test_dynamic_sampling_is_refused_with_gae() -> None:
    """buffer.filter_degenerate_groups drops the groups whose rewards are all equal, which a group-relative baseline
    gives no advantage; with trainer.advantage=gae the critic's baseline still does, so the pair is refused rather
    than their data lost. Either key alone validates."""
    with pytest.raises(ConfigError, match=r"buffer.filter_degenerate_groups needs a group-relative "
                       r"trainer.advantage \(grpo, rloo, reinforce_pp\), not gae: .* nonzero advantages"):
        load_config(None, ["buffer.filter_degenerate_groups=true", "trainer.advantage=gae"])
    assert load_config(None, ["buffer.filter_degenerate_groups=true"]).buffer.filter_degenerate_groups
    assert load_config(None, ["trainer.advantage=gae"]).trainer.advantage == "gae"


def test_a_warm_up_that_lasts_the_whole_run_is_refused() -> None:
    """A cosine schedule spans the policy's steps (total_steps, less critic.warmup_steps under gae, which train the
    critic alone): a warmup_steps that reaches their end never finishes warming up and never decays; a
    critic.warmup_steps that reaches total_steps never lets the policy train. One step shorter validates, and so
    does a constant schedule's (it does not use total_steps) or a critic's the advantage ignores."""
    run, cosine, gae = ["trainer.total_steps=10"], ["trainer.lr_schedule=cosine"], ["trainer.advantage=gae"]
    with pytest.raises(ConfigError, match=r"trainer: warmup_steps \(10\) must be below total_steps \(10\) with "
                       r"lr_schedule=cosine: the learning rate would never finish warming up"):
        load_config(None, [*run, *cosine, "trainer.warmup_steps=10"])
    with pytest.raises(ConfigError, match=r"trainer: warmup_steps \(6\) must be below total_steps \(10\) less "
                       r"critic.warmup_steps \(4\) with lr_schedule=cosine"):
        load_config(None, [*run, *cosine, *gae, "trainer.critic.warmup_steps=4", "trainer.warmup_steps=6"])
    with pytest.raises(ConfigError, match=r"trainer: critic.warmup_steps \(10\) must be below total_steps \(10\) "
                       r"with advantage=gae: .* the policy would never train"):
        load_config(None, [*run, *gae, "trainer.critic.warmup_steps=10"])
    assert load_config(None, [*run, *cosine, "trainer.warmup_steps=9"]).trainer.warmup_steps == 9
    assert load_config(None, [*run, *cosine, *gae, "trainer.critic.warmup_steps=4",
                              "trainer.warmup_steps=5"]).trainer.warmup_steps == 5
    assert load_config(None, [*run, "trainer.warmup_steps=10"]).trainer.warmup_steps == 10
    assert load_config(None, [*run, *gae, "trainer.critic.warmup_steps=9"]).trainer.critic.warmup_steps == 9
    assert load_config(None, [*run, "trainer.critic.warmup_steps=10"]).trainer.critic.warmup_steps == 10


SECRET = "s" * 31 + "#x y"  # 35 characters; YAML would cut it at " #"


@pytest.mark.parametrize("key", ["api.token", "checkpoint.token", "engine.api_key", "redis.password"])
def test_secret_overrides_are_plain_strings_never_echoed(key: str) -> None:
    section, field = key.split(".")
    cfg = load_config(None, [f"{key}={SECRET}"], env={})
    assert getattr(getattr(cfg, section), field).get_secret_value() == SECRET
    for short in ("", "abc #x"):
        with pytest.raises(ConfigError, match=f"{key}: must be at least 32 characters") as err:
            load_config(None, [f"{key}={short}"], env={})
        assert "got" not in str(err.value)


def test_secrets_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(SECRET + "\n")
    env = {"ROLLWAVE_API_TOKEN": "e" * 40, "ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40, "ROLLWAVE_ENGINE_API_KEY": "k" * 40}
    cfg = load_config(None, [f"api.token_file={token_file}"], env=env)
    assert cfg.api.token.get_secret_value() == SECRET  # the file wins over the environment
    assert cfg.checkpoint.token.get_secret_value() == "c" * 40 and cfg.engine.api_key.get_secret_value() == "k" * 40
    nothing = load_config(None, [], env={})
    assert nothing.api.token is nothing.checkpoint.token is nothing.engine.api_key is None
    with pytest.raises(ConfigError, match="set checkpoint.token or checkpoint.token_file, not both"):
        load_config(None, [f"checkpoint.token={SECRET}", f"checkpoint.token_file={token_file}"], env={})
    with pytest.raises(ConfigError, match="engine.api_key_file: cannot read .*absent"):
        load_config(None, [f"engine.api_key_file={tmp_path / 'absent'}"], env={})


@pytest.mark.parametrize("key", ["engine.api_key", "checkpoint.token"])
def test_a_secret_file_alone_sets_the_secret(tmp_path: Path, key: str) -> None:
    """``engine.api_key_file`` / ``checkpoint.token_file`` with no environment variable: the secret is the file's
    content without its surrounding whitespace, and it is what the component that needs it gets."""
    secret = "k3y-" + "x" * 36
    path = tmp_path / "secret"
    path.write_text(f"  {secret}\n\n")
    cfg = load_config(None, [f"{key}_file={path}"], env={})
    section, field = key.split(".")
    assert getattr(getattr(cfg, section), field).get_secret_value() == secret
    assert require_secret(cfg, key) == secret
    assert getattr(getattr(load_config(None, [], env={}), section), field) is None  # unset without the file


def test_dumped_configs_mask_secrets_and_read_them_back_from_the_environment(tmp_path: Path) -> None:
    cfg = load_config(None, [f"api.token={SECRET}", f"checkpoint.token={'c' * 40}"], env={})
    dumped = dump_config(cfg)
    assert SECRET not in dumped and "c" * 40 not in dumped and dumped.count(MASK) == 2
    path = tmp_path / "config.yaml"
    path.write_text(dumped)
    back = load_config(path, env={"ROLLWAVE_API_TOKEN": SECRET, "ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40})
    assert back.api.token.get_secret_value() == SECRET and back.checkpoint.token.get_secret_value() == "c" * 40
    trainer_view = load_config(path, env={"ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40})  # a trainer gets no API token
    assert trainer_view.api.token is None and require_secret(trainer_view, "checkpoint.token") == "c" * 40
    with pytest.raises(ConfigError, match="api.token: the config holds a masked secret; give it in ROLLWAVE_API_TOKEN"):
        require_secret(trainer_view, "api.token")
    with pytest.raises(ConfigError, match="api.token: the config holds a masked secret"):
        check_api_config(trainer_view)  # the API never runs without the token the operator set


def test_config_check_prints_secrets_masked(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLWAVE_CHECKPOINT_TOKEN", "c" * 40)
    monkeypatch.setenv("ROLLWAVE_API_TOKEN", SECRET)
    assert main(["config", "check", "-c", str(ROOT / "configs/demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and "c" * 40 not in out and f"token: '{MASK}'" in out


@pytest.mark.parametrize("key", ["api.token", "checkpoint.token", "engine.api_key", "redis.password"])
def test_a_secret_is_never_taken_from_a_command_line(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Other users read command lines (``ps``); a secret there is refused, by ``config check`` and components."""
    assert main(["config", "check", "-c", str(ROOT / "configs/demo.yaml"), f"{key}={SECRET}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {key}: never on the command line, where other users can read it")
    assert SECRET not in err
    with pytest.raises(SystemExit) as exit_:
        load_config_or_exit(None, [f"{key}={SECRET}"])
    assert exit_.value.code == 2 and f"{key}: never on the command line" in capsys.readouterr().err


def test_require_secret_says_where_to_put_it() -> None:
    cfg = load_config(None, [], env={})
    with pytest.raises(ConfigError, match=r"checkpoint.token is not set: give it in ROLLWAVE_CHECKPOINT_TOKEN or "
                                          r"checkpoint.token_file \(generate one with"):
        require_secret(cfg, "checkpoint.token")
    assert require_secret(load_config(None, [f"checkpoint.token={SECRET}"], env={}), "checkpoint.token") == SECRET


@pytest.mark.parametrize("server_id", ["..", ".", ".hidden", "a/b", "../x", ""])
def test_server_id_cannot_name_a_path_outside_the_stage_dir(server_id: str) -> None:
    with pytest.raises(ConfigError, match="rollout.server_id"):
        load_config(None, [f"rollout.server_id='{server_id}'"])
    assert load_config(None, ["rollout.server_id=rollout-0.a..b_c"]).rollout.server_id == "rollout-0.a..b_c"


# Input files: not UTF-8, keys given twice, a *_file that is not a path (core.text_files)

LATIN1 = "run:\n  name: caf\xe9\n".encode("latin-1")  # é as one Latin-1 byte: not UTF-8


def test_a_config_file_that_is_not_utf8_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(LATIN1)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column 12)"
    path.write_bytes(b"\xef\xbb\xbfrun:\n  name: x\n")  # a byte order mark is still allowed
    assert load_config(path).run.name == "x"
    path.write_bytes(b"\xef\xbb\xbfrun:\n  name: caf\xe9\n")
    with pytest.raises(ConfigError, match=f"^{path}:2: not valid UTF-8 \\(byte 0xe9 at column 12\\)$"):
        load_config(path)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("run: {name: a}\nmodel: {seed: 1}\nrun: {seed: 3}\n", ":3: duplicate key 'run' (first on line 1)"),
        ("run:\n  name: a\n  seed: 1\n  name: b\n", ":4: duplicate key 'name' (first on line 2)"),
        ("rollout:\n  reward_allowlist: {a: m:f, b: m:g, a: m:h}\n", ":2: duplicate key 'a' (first on line 2)"),
    ],
    ids=["top level", "nested", "flow mapping"],
)
def test_a_key_given_twice_in_a_config_file_is_an_error(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}{message}"


def test_a_merge_key_may_still_be_overridden(tmp_path: Path) -> None:
    path = tmp_path / "merge.yaml"
    path.write_text("run:\n  <<: {name: a, seed: 1}\n  seed: 3\n")
    cfg = load_config(path)
    assert (cfg.run.name, cfg.run.seed) == ("a", 3)


@pytest.mark.parametrize(
    ("where", "value", "got"),
    [("file", "[1, 2]", "a list"), ("file", "{a: 1}", "a mapping"), ("file", "3", "a number"),
     ("file", "true", "a boolean"), ("override", "[1, 2]", "a list")],
)
def test_a_secret_file_key_that_is_not_a_path_names_the_key(tmp_path: Path, where: str, value: str, got: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"api: {{token_file: {value}}}\n" if where == "file" else "")
    overrides = [f"api.token_file={value}"] if where == "override" else []
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides, env={})
    assert str(err.value) == f"api.token_file: expected a path, got {got}"


@pytest.mark.parametrize("key", ["api.token", "checkpoint.token", "engine.api_key", "redis.password"])
def test_a_secret_file_that_is_not_utf8_names_the_key_file_and_line(tmp_path: Path, key: str) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"x" * 40 + b"\n\xe9\n")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}_file={path}"], env={})
    assert str(err.value) == f"{key}_file: {path}:2: not valid UTF-8 (byte 0xe9 at column 1)"
    assert "x" * 40 not in str(err.value)  # the secret is never echoed


def test_config_check_says_a_file_is_not_utf8_in_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(LATIN1)
    assert main(["config", "check", "-c", str(path)]) == 2
    assert capsys.readouterr().err == f"error: {path}:2: not valid UTF-8 (byte 0xe9 at column 12)\n"


def test_a_check_across_keys_echoes_no_secret_and_names_no_line_an_override_set(tmp_path: Path) -> None:
    """A section's or the whole config's own check fails on its whole input, which holds the secrets taken from
    the environment: the error names the keys and never echoes that input. When an override set a key of that
    section, the error names no line of the file."""
    env = {"ROLLWAVE_CHECKPOINT_TOKEN": SECRET, "ROLLWAVE_API_TOKEN": "a" * 40}
    for overrides in (["checkpoint.quorum=0"], ["checkpoint.tls_cert=/x"],
                      ["placement.mode=colocated", "model.lora={}"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides, env=env)
        assert SECRET not in str(err.value) and "a" * 40 not in str(err.value) and "(got" not in str(err.value)
    path = tmp_path / "run.yaml"
    path.write_text("run:\n  name: x\ncheckpoint:\n  quorum: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, ["checkpoint.quorum=0"], env=env)
    assert str(err.value).splitlines()[1].strip().startswith("checkpoint: quorum must be")


@pytest.mark.parametrize("name", [".", ".."])
def test_a_run_name_cannot_leave_its_directory(name: str) -> None:
    """``run.name`` names runs/<name> and the run's staging directories, which the demo removes at its end."""
    with pytest.raises(ConfigError, match=r"run\.name: String should match pattern"):
        load_config(None, [f"run.name={name}"])
    assert load_config(None, ["run.name=a.b"]).run.name == "a.b"


def test_episodes_must_fit_the_embedded_engines_context() -> None:
    """The embedded engine refuses a request past ``engine.max_context``: a longer episode budget would make long
    episodes engine errors. Engines the rollout server does not start (``engine.urls``, SGLang) set their own."""
    with pytest.raises(ConfigError, match=r"rollout\.max_total_tokens \(2048\) exceeds engine\.max_context \(1024\)"):
        load_config(None, ["rollout.max_total_tokens=2048"])
    assert load_config(None, ["rollout.max_total_tokens=2048", "engine.max_context=2048"]).engine.max_context == 2048
    for other in ("engine.urls=[http://127.0.0.1:30000]", "engine.backend=sglang"):
        assert load_config(None, ["rollout.max_total_tokens=2048", other]).rollout.max_total_tokens == 2048


def test_a_top_k_past_the_whole_vocabulary_is_refused() -> None:
    """-1 is the whole vocabulary, which SGLang stores as 2**30; a larger top_k means the same, and one of 2**63 or
    more cannot go into the embedded engine's batch tensor, which fails every request batched with it."""
    huge = 2**63
    with pytest.raises(ValueError, match="Overflow"):  # what an unchecked top_k does to the engine's whole batch
        BatchSampler([SamplingParams(top_k=huge), SamplingParams()], [None, None], torch.Generator())
    sampler = BatchSampler([SamplingParams(top_k=TOP_K_ALL), SamplingParams()], [None, None], torch.Generator())
    assert sampler.sample(torch.zeros(2, 5))[0].shape == (2,)  # the bound itself builds and samples
    for top_k in (huge, TOP_K_ALL + 1):
        with pytest.raises(ConfigError, match=rf"rollout: top_k must be at most 2\*\*30 = {TOP_K_ALL} \(the whole "
                           rf"vocabulary, as -1\), got {top_k}"):
            load_config(None, [f"rollout.top_k={top_k}"])
        with pytest.raises(ValidationError, match=rf"top_k must be at most 2\*\*30 = {TOP_K_ALL}"):
            JobSpec.model_validate({"source": {"kind": "arith", "limit": 1}, "sampling": {"top_k": top_k}})
    assert load_config(None, [f"rollout.top_k={TOP_K_ALL}"]).rollout.top_k == TOP_K_ALL
    spec = JobSpec.model_validate({"source": {"kind": "arith", "limit": 1}, "sampling": {"top_k": TOP_K_ALL}})
    assert spec.sampling.top_k == TOP_K_ALL


def test_a_train_temperature_the_engines_sample_greedily_is_refused() -> None:
    """Below 1e-6 both engines sample greedily (SGLang's _SAMPLING_EPS, the embedded engine's rule), while the
    trainer divides the logits by the temperature: the run's rollout.temperature must be at least that."""
    assert SamplingParams(temperature=5e-7).greedy and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    for value in ("5e-7", "0"):
        with pytest.raises(ConfigError, match=r"rollout\.temperature: .* cannot be trained on: below 1e-06 the "
                           r"engines sample greedily .* use >= 1e-06"):
            load_config(None, [f"rollout.temperature={value}"])
    with pytest.raises(ConfigError, match=r"rollout\.temperature: Input should be a finite number"):
        load_config(None, ["rollout.temperature=.nan"])
    assert load_config(None, ["rollout.temperature=1e-6"]).rollout.temperature == GREEDY_TEMPERATURE


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_one_sample_per_group_is_refused_under_a_group_baseline(advantage: str) -> None:
    """A group-relative baseline is the group's other samples: with rollout.n_samples 1 every train group has
    advantage 0 (rloo divides by n - 1). GAE's baseline is the critic, so one sample trains there."""
    with pytest.raises(ConfigError, match=rf"rollout.n_samples=1 with trainer.advantage={advantage}: a group of 1 "
                       r"sample has advantage 0 .* give rollout.n_samples >= 2, or trainer.advantage=gae"):
        load_config(None, ["rollout.n_samples=1", f"trainer.advantage={advantage}"])
    assert load_config(None, ["rollout.n_samples=2", f"trainer.advantage={advantage}"]).rollout.n_samples == 2
    assert load_config(None, ["rollout.n_samples=1", "trainer.advantage=gae"]).rollout.n_samples == 1


def test_the_deploy_config_loads() -> None:
    assert load_config(ROOT / "deploy/config/run.yaml").rollout.n_samples >= 2


@pytest.mark.parametrize("entry", ["my_agents.run", "my_agents:run.attr", "my_agents:", "1bad:run"])
def test_an_agent_allowlist_entry_that_is_no_entrypoint_is_refused(entry: str) -> None:
    """rollout.agent_allowlist holds ``module:function`` entrypoints as jobs name them: anything else is refused when
    the config loads (it would refuse every sample of every job that named it)."""
    refused = rf"rollout\.agent_allowlist.*{re.escape(repr(entry))} is not module:function"
    with pytest.raises(ConfigError, match=refused):
        load_config(None, [f"rollout.agent_allowlist=[{entry!r}]"])
    assert load_config(None, ["rollout.agent_allowlist=['my_agents:run']"]).rollout.agent_allowlist == ["my_agents:run"]


def test_config_check_shows_the_redis_url_the_components_use(capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``REDIS_URL`` wins over ``redis.url`` in every component: ``config check`` shows it as ``redis.url``, and says so
    on stderr when it replaces a ``redis.url`` given (an override seemed to be ignored, the check showing the
    override or null)."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    check = ["config", "check", "-c", str(ROOT / "configs/demo.yaml")]
    assert main([*check, "redis.url=redis://127.0.0.1:7000/0"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["redis"]["url"] == "redis://127.0.0.1:7000/0" and err == ""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/1")
    assert main(check) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["redis"]["url"] == "redis://127.0.0.1:6379/1" and err == ""
    assert main([*check, "redis.url=redis://127.0.0.1:7000/0"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["redis"]["url"] == "redis://127.0.0.1:6379/1"
    assert err == ("note: redis.url: REDIS_URL in the environment (redis://127.0.0.1:6379/1) wins over "
                   "redis://127.0.0.1:7000/0\n")
