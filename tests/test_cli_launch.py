"""Starting a run with input that cannot make one: ``rollwave up`` with no trainer rank or no rollout server is an
input error (exit 2, one line, before anything starts), and a ``LocalStack`` whose component cannot be started
stops the ones it had started and names the one it could not."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from core.process import stop_process
from services.launcher import ComponentSpec, LocalStack

ROLLWAVE = Path(sysconfig.get_path("scripts")) / "rollwave"
DEMO = Path(__file__).resolve().parents[1] / "configs/demo.yaml"


@pytest.mark.parametrize(("flag", "value"), [("--trainer-ranks", "0"), ("--rollout-servers", "0"),
                                             ("--rollout-servers", "-1")])
def test_up_without_a_trainer_or_a_rollout_server_is_refused_before_anything_starts(
        flag: str, value: str, tmp_path: Path) -> None:
    """Such a run would be reported up and never train. (``RAY_ADDRESS=ray://`` is refused by ``up`` itself before
    it starts anything, so a flag the parser let through would end in that line instead, with nothing running.)"""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLWAVE_")}
    proc = subprocess.run([str(ROLLWAVE), "up", "-c", str(DEMO), f"run.dir={tmp_path / 'runs'}", flag, value],
                          cwd=tmp_path, env={**clean, "RAY_ADDRESS": "ray://127.0.0.1:1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [f"error: argument {flag.split()[0]}: must be above 0, got {value} "
                                        "(see rollwave up --help)"], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_up_help_says_what_the_counts_are(capsys: pytest.CaptureFixture) -> None:
    from services.cli import main

    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--rollout-servers R rollout servers" in text and "--trainer-ranks W trainer ranks" in text


def test_a_component_that_cannot_start_stops_the_started_ones_and_is_named(tmp_path: Path) -> None:
    sleeps = ComponentSpec("sleeps", [sys.executable, "-c", "import time; time.sleep(120)"])
    missing = ComponentSpec("missing", [str(tmp_path / "no-such-program")])
    stack = LocalStack([sleeps, missing], tmp_path / "logs")
    try:
        with pytest.raises(RuntimeError, match=r"^missing: cannot start it: \[Errno 2\] No such .*no-such-program"):
            stack.start()
        assert stack.procs["sleeps"].poll() is not None, "the component started first is still running"
        assert stack._thread is None  # no supervisor left to restart it
    finally:
        for name, proc in stack.procs.items():
            stop_process(proc, 10, name=name, group=True)


@pytest.mark.parametrize(("argv", "source", "url"), [
    (["--engine-url", "127.0.0.1:30000"], "--engine-url", "127.0.0.1:30000"),
    (["--engine-url", "http://127.0.0.1:99999"], "--engine-url", "http://127.0.0.1:99999"),
    (['engine.urls=["localhost:30000"]'], "engine.urls", "localhost:30000"),
])
def test_rollout_refuses_an_engine_url_no_engine_can_answer_on_at_once(
        argv: list[str], source: str, url: str, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL without http:// (or with no valid port) is refused naming where it came from, not polled until
    ``engine.ready_timeout_s`` (an hour by default; 30 s here) and then blamed on that key."""
    from services.cli import main

    started = time.monotonic()
    assert main(["rollout", "--task", "arith", "--model", str(tiny_model_dir), "engine.ready_timeout_s=30",
                 *argv]) == 2
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: ") and f"{source}: {url} is not an engine URL: want http(s)://host:port, " \
        "e.g. http://127.0.0.1:30000" in err[-1], err


@pytest.mark.parametrize(("servers", "threads"), [(2, 0), (1, 0), (2, 3)])
def test_rollout_servers_on_one_cpu_set_split_it_unless_engine_threads_says(
        servers: int, threads: int, tmp_path: Path) -> None:
    """Each rollout server the launcher starts pins itself to ``placement.rollout_cpus`` and runs the torch threads
    its config's ``engine.threads`` says (0: one per CPU of the set): two servers on two CPUs each run 1, not 2
    (four threads on two CPUs), as the trainer's ranks split theirs; ``engine.threads`` set is kept. (On a
    one-CPU machine the set has one CPU, and each server runs 1 either way.)"""
    from core.config import dump_config, load_config
    from core.placement import pin
    from services.launcher import components

    cpus = sorted(os.sched_getaffinity(0))[:2]
    want = [threads or max(1, len(cpus) // servers)] * servers
    cfg = load_config(None, [f"run.dir={tmp_path}", f"placement.rollout_cpus={cpus}", f"engine.threads={threads}"])
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(cfg))
    mine = os.sched_getaffinity(0)
    ran = []
    try:
        for spec in components(cfg, config_path, "redis://127.0.0.1:1", rollout_servers=servers, api=False):
            if spec.name.startswith("rollout-"):  # what the server's own start does with its command line
                argv = spec.argv[spec.argv.index("-c") + 2:]
                server_cfg = load_config(config_path, argv)
                ran.append(pin(server_cfg.placement.rollout_cpus, "placement.rollout_cpus", server_cfg.engine.threads))
    finally:
        os.sched_setaffinity(0, mine)
    assert ran == want


@pytest.mark.parametrize("argv", [["up", "-c", str(DEMO), "--trainer-ranks", "two"], ["rollout", "--task", "arith",
                                  "--n", "two"], ["status", "--interval", "soon"], ["submit", "--timeout", "x"]])
def test_a_count_or_duration_that_is_no_number_is_named_as_argparse_names_it(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    flag, value = argv[-2:]
    kind = "int" if flag in ("--trainer-ranks", "--n") else "float"
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: argument {flag}: invalid {kind} value: '{value}' (see ")
