"""Every ``rollwave`` subcommand with bad input, run as a user runs it (the installed entry point in a
subprocess): exit 2 for a mistake in the input, 1 for a runtime failure, and exactly one ``error:`` line
on stderr, never a traceback unless ``--debug`` asks for it."""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import build_parser, main

ROLLWAVE = Path(sysconfig.get_path("scripts")) / "rollwave"
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs/demo.yaml"
TOKEN = secrets.token_urlsafe(32)


def rollwave(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    return subprocess.run(
        [str(ROLLWAVE), *argv], cwd=cwd, env={**clean, **(env or {})}, capture_output=True, text=True, timeout=120
    )


def assert_one_error_line(proc: subprocess.CompletedProcess[str], code: int, needle: str) -> str:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def dead_api() -> Iterator[str]:
    """A 127.0.0.1 port that refuses connections: bound (so nothing else takes it) but not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


BAD_INPUT = [  # (argv, what the error line must name); {tmp} is the test's directory, {demo} the demo config
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["rollout"], "the following arguments are required: --task"),
    (["config", "check", "-c", "{tmp}/missing.yaml"], "config file {tmp}/missing.yaml does not exist"),
    (["config", "check", "-c", "{demo}", "nope.key=1"], "nope: unknown key"),
    (["config", "check", "-c", "{demo}", "trainer.lr=fast"], "trainer.lr: Input should be a valid number"),
    (["config", "check", "-c", "{demo}", "trainer.lr"], "expected dotted.key=value"),
    (["model", "init", "--out", "{tmp}/a-file/model"], "{tmp}/a-file: File exists (remove it or pick another path)"),
    (["engine", "sglang", "--model", "m", "--port", "0", "--dry-run"], "--port must be in 1..65535, got 0"),
    (["engine", "sglang", "--model", "m", "--port", "65536"], "--port must be in 1..65535, got 65536"),
    (["engine", "sglang", "--model", "m", "--port", "http"], "argument --port: invalid int value: 'http'"),
    (["engine", "sglang", "--model", "m", "--port", "1", "--python", "{tmp}/py"], "--python {tmp}/py: no such program"),
    (["rollout", "--task", "nosuch"], "unknown task source 'nosuch'; valid: arith, gsm8k, jsonl"),
    (["rollout", "--task", "gsm8k", "--path", "/nonexistent/gsm8k"],
     "task source 'gsm8k': no such file: /nonexistent/gsm8k"),
    (["rollout", "--task", "jsonl", "--path", "{tmp}/none.jsonl"], "no such file: {tmp}/none.jsonl"),
    (["rollout", "--task", "arith", "--model", "{tmp}/nomodel"], "--model: {tmp}/nomodel does not exist"),
    (["rollout", "--task", "arith", "-c", "{tmp}/missing.yaml"], "config file {tmp}/missing.yaml does not exist"),
    (["up", "-c", "{tmp}/missing.yaml"], "config file {tmp}/missing.yaml does not exist"),
    (["up", "-c", "{demo}", "--rollout-servers", "two"], "argument --rollout-servers: invalid int value"),
    (["down", "-c", "{demo}", "redis.port=70000"], "redis.port: Input should be less than or equal to 65535"),
    (["up", "-c", "{demo}", "redis.unix_socket=true"],
     "redis.unix_socket: `rollwave up` runs the embedded Redis in a Ray actor, which the components reach over TCP"),
    # a secret on the command line is refused by every command that takes overrides, before it reads its config
    (["up", "-c", "{demo}", "api.token=" + "t" * 40], "api.token: never on the command line"),
    (["down", "-c", "{demo}", "redis.password=" + "p" * 40], "redis.password: never on the command line"),
    (["rollout", "--task", "arith", "engine.api_key=" + "k" * 40], "engine.api_key: never on the command line"),
    (["submit", "-f", "{tmp}/missing.yaml"], "job file {tmp}/missing.yaml does not exist"),
    (["submit", "-f", "{tmp}/bad.yaml"], "{tmp}/bad.yaml:2: not valid YAML"),
    (["submit", "-f", "{tmp}"], "{tmp}: Is a directory"),
    (["submit", "--source", "nosuch"], "argument --source: invalid choice: 'nosuch'"),
    (["jobs", "--api", "localhost:8000"], "--api localhost:8000"),
    # input files that are not UTF-8, name a key twice, or hold the wrong kind of value
    (["config", "check", "-c", "{tmp}/latin1.yaml"], "{tmp}/latin1.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)"),
    (["config", "check", "-c", "{tmp}/dup.yaml"], "{tmp}/dup.yaml:3: duplicate key 'run' (first on line 1)"),
    (["config", "check", "-c", "{tmp}/secret-list.yaml"], "api.token_file: expected a path, got a list"),
    (["config", "check", "-c", "{demo}", "api.token_file={tmp}/latin1.yaml"],
     "api.token_file: {tmp}/latin1.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)"),
    (["submit", "-f", "{tmp}/latin1.yaml"], "{tmp}/latin1.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)"),
    (["submit", "-f", "{tmp}/job-dup.yaml"], "{tmp}/job-dup.yaml:2: duplicate key 'kind' (first on line 1)"),
    (["submit", "-f", "{tmp}/job-source.yaml", "--limit", "3"],
     "{tmp}/job-source.yaml:1: source must be a mapping, got 'arith'"),
    (["submit", "-f", "{tmp}/job-sampling.yaml", "--temperature", "0.7"],
     "{tmp}/job-sampling.yaml:2: sampling must be a mapping, got 0.5"),
    (["submit", "--token-file", "{tmp}/latin1.yaml", "--limit", "2"],
     "--token-file {tmp}/latin1.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)"),
    (["rollout", "--task", "jsonl", "--path", "{tmp}/latin1.jsonl"],
     "{tmp}/latin1.jsonl:1: not valid UTF-8 (byte 0xe9 at column 11)"),
    (["rollout", "--task", "arith", "rollout.tools={tmp}/latin1.yaml"],
     "{tmp}/latin1.yaml:2: not valid UTF-8 (byte 0xe9 at column 12)"),
    (["rollout", "--task", "arith", "rollout.tools={tmp}/dup.yaml"],
     "{tmp}/dup.yaml:3: duplicate key 'run' (first on line 1)"),
    (["trajectories"], "the following arguments are required: job"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "bad.yaml").write_text("kind: [train\n")
    (tmp_path / "latin1.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"q": "caf\xe9"}\n')
    (tmp_path / "dup.yaml").write_text("run: {name: a}\nmodel: {seed: 1}\nrun: {seed: 3}\n")
    (tmp_path / "secret-list.yaml").write_text("api: {token_file: [1, 2]}\n")
    (tmp_path / "job-dup.yaml").write_text("kind: train\nkind: eval\nsource: {kind: arith, limit: 2}\n")
    (tmp_path / "job-source.yaml").write_text("source: arith\n")
    (tmp_path / "job-sampling.yaml").write_text("source: {kind: arith, limit: 2}\nsampling: 0.5\n")
    fill = {"tmp": str(tmp_path), "demo": str(DEMO)}
    proc = rollwave(*(a.format(**fill) for a in argv), cwd=tmp_path)
    assert_one_error_line(proc, 2, needle.format(**fill))


def test_a_bad_secret_from_the_environment_is_not_blamed_on_a_line_of_the_file(tmp_path: Path) -> None:
    proc = rollwave("config", "check", "-c", str(DEMO), cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": "short"})
    line = assert_one_error_line(proc, 2, "api.token: must be at least 32 characters")
    assert "(given in api.token_file or ROLLWAVE_API_TOKEN)" in line and not re.search(r"demo\.yaml:\d", line)


def test_a_trainer_over_another_runs_checkpoints_exits_2_in_one_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Starting over where checkpoints are is refused (see test_trainer_resume) as a config is: one line, exit 2,
    which a launcher does not restart (it would only be refused again)."""
    (tmp_path / "runs" / "r" / "checkpoints" / "step_00000003").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "checkpoints" / "step_00000003" / "trainer_state.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", f"run.dir={tmp_path / 'runs'}", "run.name=r", f"model.path={tiny_model_dir}",
         "trainer.metrics_port=null"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**env, "ROLLWAVE_CHECKPOINT_TOKEN": "c" * 40})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in proc.stderr and len(errors) == 1, proc.stderr[-3000:]
    assert "checkpoints holds checkpoints (latest step_00000003) and resume is off" in errors[0]


def test_the_demo_refuses_a_secret_on_its_command_line_and_a_bad_key_in_one_line(tmp_path: Path) -> None:
    for override, needle in (("checkpoint.token=" + "c" * 40, "checkpoint.token: never on the command line"),
                             ("nope.key=1", "nope: unknown key")):
        proc = subprocess.run([sys.executable, "-m", "services.demo", f"run.dir={tmp_path}", override], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_up_through_ray_client_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """``rollwave up`` runs the embedded Redis on the node it runs on, which a Ray Client (``ray://``) driver is not."""
    proc = rollwave("up", "-c", str(DEMO), f"run.dir={tmp_path / 'runs'}", cwd=tmp_path,
                    env={"RAY_ADDRESS": "ray://head:10001"})
    assert_one_error_line(proc, 2, "RAY_ADDRESS=ray://head:10001: `rollwave up` runs the embedded Redis on the node "
                          "it runs on and talks to it, and a Ray Client (ray://) driver is no node")
    assert not (tmp_path / "runs").exists()


def test_an_environment_without_sglang_is_named_with_the_fix(tmp_path: Path) -> None:
    assert importlib.util.find_spec("sglang") is None, "this test needs the CPU environment, which has no sglang"
    argv = ["engine", "sglang", "--model", "m", "--port", "30000"]
    line = assert_one_error_line(rollwave(*argv, cwd=tmp_path), 2, "cannot import sglang")
    assert "No module named 'sglang'" in line and "--python" in line
    dry = rollwave(*argv, "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0 and dry.stdout.split()[1:3] == ["-m", "sglang.launch_server"]
    warning = dry.stderr.splitlines()
    assert len(warning) == 1 and warning[0].startswith("warning: ") and "cannot import sglang" in warning[0]
    assert "--tool-call-parser qwen assumes sglang >= 0.5.3.post1" in warning[0]


@pytest.mark.parametrize("argv", [["status"], ["jobs"], ["trajectories", "JOB", "--all"], ["submit", "--limit", "2"]])
def test_an_unreachable_api_says_how_to_start_or_find_it(argv: list[str], dead_api: str, tmp_path: Path) -> None:
    proc = rollwave(*argv, "--api", dead_api, cwd=tmp_path)
    line = assert_one_error_line(proc, 1, f"cannot reach the API at {dead_api}")
    assert "rollwave up" in line and "--api / ROLLWAVE_API" in line


def test_an_api_that_does_not_answer_in_time_is_named_with_the_call(dead_api: str) -> None:
    """A timeout's own text is only "timed out": the line names the API and the call that got no answer."""
    import argparse

    import httpx

    from services.cli import _explain

    timeout = httpx.ReadTimeout("timed out", request=httpx.Request("GET", f"{dead_api}/v1/jobs"))
    line, code = _explain(timeout, argparse.Namespace(api=dead_api))
    assert code == 1 and line.startswith(f"the API at {dead_api} did not answer GET {dead_api}/v1/jobs in time"), line


def test_rollwave_api_env_names_the_url_it_tried(dead_api: str, tmp_path: Path) -> None:
    assert_one_error_line(rollwave("jobs", cwd=tmp_path, env={"ROLLWAVE_API": dead_api}), 1, dead_api)


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real API on a real (embedded) Redis, with a bearer token."""
    from buffer.redis_server import EmbeddedRedis
    from core.config import load_config
    from services.api import create_app
    from tests.http_harness import serve_app

    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), aof=False) as redis:
        cfg = load_config(None, ["run.name=cli-errors", f"redis.url={redis.url}", f"api.token={TOKEN}"])
        with serve_app(create_app(cfg)) as url:
            yield url


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["trajectories", "nosuchjob"], "HTTP 404: job 'nosuchjob' not found"),
        (["submit", "--source", "arith", "--limit", "0"], "HTTP 422: source.limit: Input should be"),
        (["submit", "--limit", "2", "--n", "0"], "HTTP 422: n_samples: Input should be greater"),
        (["submit", "--source", "jsonl"], "HTTP 422: source: Value error, kind=jsonl needs `path`"),
        (["submit", "--limit", "2", "--reward", "os:system"], "HTTP 422: reward: Value error, reward 'os:system'"),
        (["jobs", "--token-file", "/nonexistent/token"], "/nonexistent/token: No such file or directory"),
    ],
)
def test_api_refusals_are_one_line_naming_the_problem(argv: list[str], needle: str, live_api: str, tmp_path: Path):
    proc = rollwave(*argv, "--api", live_api, cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": TOKEN})
    assert_one_error_line(proc, 2, needle)


def test_a_job_file_field_the_api_refuses_is_named_by_its_line(live_api: str, tmp_path: Path) -> None:
    """The API's 422 names fields of the body; for a job file the error line adds where each is in the file,
    except a field a flag set, whose value is not the file's."""
    (tmp_path / "job.yaml").write_text("kind: train\nsource:\n  kind: arith\n  limit: 0\nn_samples: 0\n")
    env = {"ROLLWAVE_API_TOKEN": TOKEN}
    line = assert_one_error_line(rollwave("submit", "-f", "job.yaml", "--api", live_api, cwd=tmp_path, env=env),
                                 2, "HTTP 422: ")
    assert "job.yaml:4: source.limit: Input should be" in line and "job.yaml:5: n_samples: Input should be" in line
    line = assert_one_error_line(rollwave("submit", "-f", "job.yaml", "--limit", "-1", "--n", "2", "--api", live_api,
                                          cwd=tmp_path, env=env), 2, "HTTP 422: source.limit: Input should be")
    assert "job.yaml:" not in line


def test_wait_gives_up_after_the_timeout_naming_the_job(live_api: str, tmp_path: Path) -> None:
    """No rollout server serves this API, so the job never finishes: ``--timeout 2`` ends the wait, exit 1."""
    proc = rollwave("submit", "--source", "arith", "--limit", "2", "--wait", "--timeout", "2", "--api", live_api,
                    cwd=tmp_path, env={"ROLLWAVE_API_TOKEN": TOKEN})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]  # the rest: the progress bar
    assert errors == [proc.stderr.splitlines()[-1]], proc.stderr
    assert errors[0].startswith("error: TimeoutError: job ")
    assert f"at {live_api}: still running after 2 s, 0 of 2 tasks finished" in errors[0]


def test_a_missing_or_wrong_token_says_where_to_give_it(live_api: str, tmp_path: Path) -> None:
    hint = "HTTP 401: missing or wrong bearer token (give the run's api.token in ROLLWAVE_API_TOKEN or --token-file)"
    assert_one_error_line(rollwave("jobs", "--api", live_api, cwd=tmp_path), 2, hint)
    wrong = tmp_path / "token"
    wrong.write_text("x" * 40 + "\n")
    assert_one_error_line(rollwave("jobs", "--api", live_api, "--token-file", str(wrong), cwd=tmp_path), 2, hint)
    right = tmp_path / "right"
    right.write_text(TOKEN + "\n")
    proc = rollwave("jobs", "--api", live_api, "--token-file", str(right), cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("JOB "), proc.stderr


def test_debug_shows_the_traceback(dead_api: str, tmp_path: Path) -> None:
    for argv, env in [
        (["--debug", "status", "--api", dead_api], None),
        (["status", "--debug", "--api", dead_api], None),
        (["status", "--api", dead_api], {"ROLLWAVE_DEBUG": "1"}),
    ]:
        proc = rollwave(*argv, cwd=tmp_path, env=env)
        assert proc.returncode == 1
        assert proc.stderr.startswith("Traceback") and "httpx.ConnectError" in proc.stderr
        assert proc.stderr.splitlines()[-1].startswith(f"error: cannot reach the API at {dead_api}")


COMMANDS = [["config"], ["config", "check"], ["model"], ["model", "init"], ["engine"], ["engine", "sglang"],
            ["rollout"], ["up"], ["down"], ["submit"], ["status"], ["jobs"], ["trajectories"]]


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_help_says_what_it_does_with_an_example_that_parses(path: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    example = help_text.split("example:\n", 1)[1].strip().splitlines()[0]
    argv = shlex.split(example)
    assert argv[0] == "rollwave" and argv[1] == path[0]
    assert build_parser().parse_args(argv[1:]).command == path[0]


def test_top_level_help_is_for_users(tmp_path: Path) -> None:
    proc = rollwave("--help", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""
    assert "trains LLM agents with reinforcement learning" in proc.stdout
    assert "rollwave up -c configs/demo.yaml" in proc.stdout and "--debug" in proc.stdout
    assert "dispatcher" not in proc.stdout


def test_submit_flags_lay_their_keys_over_the_job_file(tmp_path: Path) -> None:
    """Each flag sets its key of the body, over the file's value, and leaves the file's other keys as they are."""
    from services.client_cmd import job_from_args

    job = tmp_path / "job.yaml"
    job.write_text("kind: train\nsource: {kind: arith, limit: 8, split: train}\nsampling: {top_p: 0.9}\nn_samples: 4\n")
    args = build_parser().parse_args(["submit", "-f", str(job), "--limit", "3", "--temperature", "0.7", "--tools",
                                      "calculator,python", "--n", "2", "--seed", "5"])
    assert job_from_args(args) == {
        "kind": "train", "source": {"kind": "arith", "limit": 3, "split": "train", "seed": 5},
        "sampling": {"top_p": 0.9, "temperature": 0.7}, "n_samples": 2, "tools": ["calculator", "python"],
    }
    assert job_from_args(build_parser().parse_args(["submit", "--max-turns", "3"])) == {"source": {}, "max_turns": 3}


def test_python_m_services_cli_keeps_each_errors_exit_code(tmp_path: Path) -> None:
    """Run as ``python -m services.cli`` (as the Ray test and Ray jobs do), the CLI is ``__main__``: an error a
    handler raises must still end with its own exit code and line, not exit 1 naming ``CliError``."""
    (tmp_path / "job-source.yaml").write_text("source: arith\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "submit", "-f", str(tmp_path / "job-source.yaml"),
                           "--limit", "3"], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc, 2, f"{tmp_path}/job-source.yaml:1: source must be a mapping, got 'arith'")
