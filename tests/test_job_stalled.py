"""A train job the trainer will no longer train says so: the trainer records its end in Redis (a crash too), the
API reads such a job ``stalled`` with the reason (and so does the dashboard), refuses new train jobs (409) until a
trainer starts again, lets a stalled job be cancelled, and ``rollwave submit --wait`` ends at once with exit 1
instead of waiting for its timeout (after a crash: once no restart came). Real API, real Redis, the real trainer,
the installed CLI and headless Chromium."""

from __future__ import annotations

import contextlib
import html
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from trainer_helpers import synthetic_groups, trainer_config

from buffer.keys import Keys
from buffer.replay import ReplayBuffer
from buffer.staleness import StalenessControl
from buffer.task_queue import TaskQueue
from core.checkpoint_format import MODEL_WEIGHTS
from core.config import CONFIG_ERROR_EXIT, BufferConfig, TrainerConfig, load_config
from core.jobs import TaskSource
from core.process import stop_process
from services.api import create_app
from services.cli import CliError
from services.client_cmd import wait_for_job
from tests.buffer_helpers import make_group
from tests.chromium_harness import dump_dom
from tests.http_harness import serve_app
from trainer.checkpoint import STATE_FILE
from trainer.metrics import RedisStatus
from trainer.parallel import DistContext
from trainer.worker import Trainer

ROLLWAVE = Path(sysconfig.get_path("scripts")) / "rollwave"
TOKEN = secrets.token_urlsafe(32)
GPS = 2


@contextlib.contextmanager
def served_run(redis_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[httpx.Client, redis.Redis, Keys]]:
    """The API of a run of its own (named after the test), an authorized client, a Redis client and the keys."""
    name = request.node.name.replace("_", "-")[:60]
    cfg = load_config(None, [f"run.name={name}", f"redis.url={redis_url}", f"api.token={TOKEN}"], env={})
    client = redis.Redis.from_url(redis_url)
    try:
        with serve_app(create_app(cfg)) as url:
            # a connection a request each: the tests wait minutes between requests (a trainer's run), and a kept-alive
            # connection the server closes for idleness just as the next request goes out is reset under load
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30,
                              limits=httpx.Limits(max_keepalive_connections=0)) as api:
                yield api, client, Keys(name)
    finally:
        client.close()


@pytest.fixture
def run(redis_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[httpx.Client, redis.Redis, Keys]]:
    with served_run(redis_url, request) as parts:
        yield parts


def _submit(api: httpx.Client, kind: str, limit: int) -> str:
    reply = api.post("/v1/jobs", json={"kind": kind, "source": {"kind": "arith", "split": "train", "limit": limit}})
    assert reply.status_code == 201, reply.text
    return reply.json()["job_id"]


def _roll_out_one(client: redis.Redis, keys: Keys) -> ReplayBuffer:
    """One train task rolled out (its group written with its task acked); returns the trainer's reader."""
    queue, cfg = TaskQueue(client, keys, BufferConfig()), BufferConfig()
    reader = ReplayBuffer(client, keys, cfg, consumer="trainer")
    reader.ensure_group()
    [entry] = queue.read("rollout-0", 1, kinds=("train",))
    writer = ReplayBuffer(client, keys, cfg, consumer="rollout-0")
    assert writer.put(make_group(entry.job_id, entry.group_id, run=keys.run), task=entry, timeout_s=10)
    return reader


def _train_one(client: redis.Redis, keys: Keys) -> None:
    """One train task rolled out and trained (acked by the trainer)."""
    reader = _roll_out_one(client, keys)
    [(entry_id, group)] = reader.take(1, 5.0)
    assert reader.ack([entry_id], [group.group_id]) == 1


def _start_trainer(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ROLLWAVE_CHECKPOINT_TOKEN": secrets.token_urlsafe(32)}
    env.pop("REDIS_URL", None)
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "trainer", "-c", str(config)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def test_a_train_job_with_groups_left_when_the_trainer_finished_reads_stalled(run) -> None:
    api, client, keys = run
    trained = _submit(api, "train", 1)
    _train_one(client, keys)
    left = _submit(api, "train", 3)
    evaluated = _submit(api, "eval", 2)
    cancelled = _submit(api, "train", 2)
    assert api.post(f"/v1/jobs/{cancelled}/cancel").json()["state"] == "cancelled"
    job = api.get(f"/v1/jobs/{left}").json()
    assert (job["state"], job["reason"]) == ("running", None)

    status = RedisStatus(client, keys)
    status.finished(4, "trainer.total_steps", 2, 2)
    job = api.get(f"/v1/jobs/{left}").json()
    assert job["state"] == "stalled"
    assert job["reason"].startswith("the trainer finished at step 4 (trainer.total_steps); 3 of this job's 3 groups "
                                    "will not be trained (start the trainer again to train them: python -m trainer "
                                    "--resume, trainer.total_steps above 4)"), job["reason"]
    states = {j["job_id"]: j["state"] for j in api.get("/v1/jobs").json()["jobs"]}
    assert states == {trained: "done", left: "stalled", evaluated: "running", cancelled: "cancelled"}
    table = subprocess.run([str(ROLLWAVE), "jobs", "--api", str(api.base_url)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "ROLLWAVE_API_TOKEN": TOKEN})
    assert re.search(rf"^{left} +train +stalled +0/3 ", table.stdout, re.M), table.stdout + table.stderr
    shown = subprocess.run([str(ROLLWAVE), "status", "--api", str(api.base_url)], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "ROLLWAVE_API_TOKEN": TOKEN})
    assert "finished at step 4 (trainer.total_steps)" in shown.stdout, shown.stdout + shown.stderr

    status.started()  # a trainer starts again: it trains the job's groups
    job = api.get(f"/v1/jobs/{left}").json()
    assert (job["state"], job["reason"]) == ("running", None)


def test_a_train_job_submitted_after_the_trainer_finished_is_refused(run) -> None:
    api, client, keys = run
    RedisStatus(client, keys).finished(3, "trainer.stop_when_drained", 1, 1)
    reply = api.post("/v1/jobs", json={"kind": "train", "source": {"kind": "arith", "limit": 2}})
    assert reply.status_code == 409, reply.text
    assert reply.json()["detail"] == (
        "the trainer finished at step 3 (trainer.stop_when_drained): a train job submitted now would never be "
        "trained; start the trainer again (python -m trainer --resume, trainer.total_steps above 3), then submit")
    assert client.hlen(keys.jobs) == 0  # nothing written
    metrics = api.get("/metrics").text
    assert "rollwave_api_jobs_rejected_total 1.0" in metrics
    assert 'rollwave_api_requests_refused_total{reason="trainer_finished"} 1.0' in metrics
    _submit(api, "eval", 1)  # an eval job needs no trainer
    RedisStatus(client, keys).started()
    _submit(api, "train", 1)


def test_submit_wait_ends_at_once_with_exit_1_when_the_trainer_finishes(run) -> None:
    """``--timeout 300``, yet the wait ends within seconds of the trainer's end, naming the job and why."""
    api, client, keys = run
    proc = subprocess.Popen(
        [str(ROLLWAVE), "submit", "--source", "arith", "--limit", "2", "--wait", "--timeout", "300",
         "--api", str(api.base_url)],
        env={**os.environ, "ROLLWAVE_API_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not client.hlen(keys.jobs):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        RedisStatus(client, keys).finished(5, "trainer.total_steps", 0, 0)
        finished = time.monotonic()
        out, err = proc.communicate(timeout=30)
        waited = time.monotonic() - finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    [job_id] = [j.decode() for j in client.hkeys(keys.jobs)]
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (
        f"error: job {job_id} at {api.base_url} is stalled: the trainer finished at step 5 (trainer.total_steps); 2 of "
        "this job's 2 groups will not be trained (start the trainer again to train them: python -m trainer --resume, "
        "trainer.total_steps above 5)"), err
    assert waited < 15, waited  # the poll (1 s) and the CLI's exit, far from the 300 s timeout


def test_the_trainer_records_where_and_why_it_stopped(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    """``python -m trainer`` with ``trainer.stop_when_drained`` clears an earlier trainer's end as it starts, trains
    one step, waits while a train task is queued, and once that is gone stops at step 1 of 5 and says so; admission
    closes at what it trained."""
    client, keys = redis.Redis.from_url(redis_url), Keys("drained-end")
    buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    assert buffer.put_many(synthetic_groups(0, GPS, run=keys.run)) == [1] * GPS
    queue = TaskQueue(client, keys, BufferConfig())
    queue.ensure_groups()
    queue.submit("later", [TaskSource(kind="arith", limit=1).load()[0].model_dump()])  # the data has not run out
    RedisStatus(client, keys).finished(9, "trainer.total_steps", 0, 0)  # an earlier trainer's end
    config = trainer_config(tmp_path, keys, redis_url, tiny_model_dir, GPS, total_steps=5, stop_when_drained=True)
    log = tmp_path / "trainer.log"
    proc = _start_trainer(config, log)
    try:
        deadline = time.monotonic() + 240
        while client.hget(keys.trainer, "step") != b"1":
            assert proc.poll() is None, f"trainer exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no step 1 in 240 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        assert client.hget(keys.trainer, "finished_step") is None  # cleared at its start
        [entry] = queue.read("rollout-0", 1, kinds=("train",))
        assert queue.dead_letter(entry, "the test takes it away: no train task is left")
        proc.wait(120)
    finally:
        stop_process(proc, 30, name="trainer")
    assert proc.returncode == 0, log.read_text()[-3000:]
    status = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
    assert (status["step"], status["finished_step"], status["finished_reason"]) == (
        "1", "1", "trainer.stop_when_drained")
    assert status["finished_at"] == status["heartbeat"]
    staleness = StalenessControl(client, keys, BufferConfig(groups_per_step=GPS))
    assert staleness.budget() == staleness.trained() == GPS  # not 5 steps' worth: nothing more is generated


def test_a_trainer_that_reaches_total_steps_says_so(ctx: DistContext, tiny_model_dir: Path, redis_url: str,
                                                   tmp_path: Path) -> None:
    buffer = ReplayBuffer(redis.Redis.from_url(redis_url), Keys("steps-end"), BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    buffer.put_many(synthetic_groups(0, 2 * GPS, run="steps-end"))
    cfg = TrainerConfig(total_steps=1, micro_batch_tokens=128, take_timeout_s=0.5, device="cpu")
    trainer = Trainer(cfg, tiny_model_dir, tmp_path, BufferConfig(groups_per_step=GPS)).start(ctx=ctx)
    try:
        assert trainer.run(buffer) == "trainer.total_steps"
    finally:
        trainer.close()
    assert trainer.step == 1


def test_a_crashed_trainer_says_why_until_a_restart_trains_again(run, tiny_model_dir: Path, redis_url: str,
                                                                 tmp_path: Path) -> None:
    """``python -m trainer`` crashes at step 1 (the ``steps`` key holds a string: Redis refuses the step's record):
    it records its end as ``crashed: <error>`` and fails, the train job reads ``stalled`` naming the error, and a
    train job is still taken (a restart trains it). A trainer refused at its start-up (checkpoints, no ``--resume``)
    records that as its end in turn, and exits with the status no launcher restarts; one past its start-up clears
    the end, and the job runs again."""
    api, client, keys = run
    job_id = _submit(api, "train", 1)
    buffer = ReplayBuffer(client, keys, BufferConfig(), consumer="trainer")
    buffer.ensure_group()
    assert buffer.put_many(synthetic_groups(0, 2 * GPS, run=keys.run)) == [1] * (2 * GPS)
    client.set(keys.steps, "no stream")
    config = trainer_config(tmp_path, keys, redis_url, tiny_model_dir, GPS, total_steps=5)
    log = tmp_path / "trainer.log"
    proc = _start_trainer(config, log)
    try:
        assert proc.wait(240) == 1, log.read_text()[-3000:]
    finally:
        stop_process(proc, 30, name="trainer")
    status = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
    error = status["finished_reason"].removeprefix("crashed: ")
    assert status["finished_step"] == "1" and error.startswith("ResponseError: ") and error.endswith(
        "WRONGTYPE Operation against a key holding the wrong kind of value"), status
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["state"], job["reason"]) == ("stalled", (
        f"the trainer crashed at step 1 ({error}); 1 of this job's 1 groups wait for a trainer (LocalStack and Ray "
        "restart a crashed one, which trains them once it is up again; by hand: python -m trainer --resume)")), job
    _submit(api, "train", 1)  # taken: the restarted trainer trains it

    ckpt = tmp_path / keys.run / "checkpoints" / "step_00000009"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / STATE_FILE).write_text("{}")
    proc = _start_trainer(config, log)
    try:
        assert proc.wait(240) == CONFIG_ERROR_EXIT, log.read_text()[-3000:]
    finally:
        stop_process(proc, 30, name="trainer")
    status = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
    assert status["finished_step"] == "0" and status["finished_reason"].startswith(
        "crashed: CheckpointMismatch: ") and "holds checkpoints" in status["finished_reason"], status

    shutil.rmtree(tmp_path / keys.run / "checkpoints")
    client.delete(keys.steps)
    proc = _start_trainer(config, log)
    try:
        deadline = time.monotonic() + 240
        while api.get(f"/v1/jobs/{job_id}").json()["state"] != "running":
            assert proc.poll() is None, f"trainer exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the job is still stalled after 240 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        stopped = stop_process(proc, 30, name="trainer")
    assert stopped == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert client.hget(keys.trainer, "finished_reason").decode() == (  # stopped before its end: a restart takes it up
        "crashed: stopped by SIGTERM before its end (a supervisor's or an operator's stop)")


def test_a_trainer_that_crashes_in_its_start_up_says_why(run, tiny_model_dir: Path, redis_url: str,
                                                         tmp_path: Path) -> None:
    """``python -m trainer`` connects, then fails to load its model (a weights file cut short): it used to record
    nothing, so a fresh run's train job read ``running`` and ``rollwave submit --wait`` waited for a trainer that
    never came. It records ``crashed: <error>`` at step 0 and closes admission; the job reads ``stalled`` with the
    reason, and a wait ends with it once no restart took the job up."""
    api, client, keys = run
    job_id = _submit(api, "train", 1)
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    weights = model / MODEL_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])
    log = tmp_path / "trainer.log"
    proc = _start_trainer(trainer_config(tmp_path, keys, redis_url, model, GPS, total_steps=5), log)
    try:
        assert proc.wait(240) == 1, log.read_text()[-3000:]
    finally:
        stop_process(proc, 30, name="trainer")
    status = {k.decode(): v.decode() for k, v in client.hgetall(keys.trainer).items()}
    assert status.get("finished_step") == "0" and status["finished_reason"].startswith("crashed: "), status
    error = status["finished_reason"].removeprefix("crashed: ")
    assert error.split(":")[0] in log.read_text(), (error, log.read_text()[-3000:])  # the exception that stopped it
    staleness = StalenessControl(client, keys, BufferConfig(groups_per_step=GPS))
    assert staleness.budget() == staleness.trained() == 0
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert (job["state"], job["reason"]) == ("stalled", (
        f"the trainer crashed at step 0 ({error}); 1 of this job's 1 groups wait for a trainer (LocalStack and Ray "
        "restart a crashed one, which trains them once it is up again; by hand: python -m trainer --resume)")), job
    with pytest.raises(CliError, match=re.escape(f"is stalled: the trainer crashed at step 0 ({error})")):
        wait_for_job(api, job_id, timeout_s=60, poll_s=0.2, restart_wait_s=0.5)


def test_submit_wait_gives_a_crashed_trainer_time_to_come_back(run) -> None:
    """Stalled by a crash, a wait goes on for ``restart_wait_s``: a restart that trains the job ends it ``done``;
    no restart within it ends it with the reason and how long it waited."""
    api, client, keys = run
    job_id = _submit(api, "train", 1)
    status = RedisStatus(client, keys)
    status.finished(2, "crashed: RuntimeError: CUDA error: an illegal memory access was encountered", 0, 0)
    started = time.monotonic()
    with pytest.raises(CliError) as refused:
        wait_for_job(api, job_id, timeout_s=60, poll_s=0.2, restart_wait_s=1.0)
    assert 1.0 <= time.monotonic() - started < 15
    assert str(refused.value) == (
        f"job {job_id} at {api.base_url} is stalled: the trainer crashed at step 2 (RuntimeError: CUDA error: an "
        "illegal memory access was encountered); 1 of this job's 1 groups wait for a trainer (LocalStack and Ray "
        "restart a crashed one, which trains them once it is up again; by hand: python -m trainer --resume) (no "
        "trainer took it up within 1 s)")

    def restarted() -> None:
        status.started()
        _train_one(client, keys)

    timer = threading.Timer(1.0, restarted)
    timer.start()
    try:
        job = wait_for_job(api, job_id, timeout_s=60, poll_s=0.2, restart_wait_s=60)
    finally:
        timer.join(30)
    assert (job["state"], job["progress"]["trained"]) == ("done", 1), job


def test_a_stalled_job_can_be_cancelled_and_a_done_one_says_why_not(run) -> None:
    """Cancelled once stalled, a job's groups are acked away untrained when a trainer starts again; a job with
    nothing left to cancel gets 409 naming its state, counted."""
    api, client, keys = run
    trained = _submit(api, "train", 1)
    _train_one(client, keys)
    left = _submit(api, "train", 1)
    reader = _roll_out_one(client, keys)
    RedisStatus(client, keys).finished(1, "trainer.total_steps", 1, 1)
    assert api.get(f"/v1/jobs/{left}").json()["state"] == "stalled"
    job = api.post(f"/v1/jobs/{left}/cancel").json()
    assert (job["state"], job["reason"]) == ("cancelled", None), job
    assert api.post(f"/v1/jobs/{left}/cancel").json()["state"] == "cancelled"  # again: as it is
    assert api.post(f"/v1/jobs/{trained}/cancel").status_code == 409  # every group trained
    assert 'rollwave_api_requests_refused_total{reason="not_cancellable"} 1.0' in api.get("/metrics").text
    RedisStatus(client, keys).started()
    assert reader.take(1, 0.5) == []  # its group is acked away, never trained
    job = api.get(f"/v1/jobs/{left}").json()
    assert (job["state"], job["progress"]["cancelled"], job["progress"]["trained"]) == ("cancelled", 1, 0), job


def test_the_dashboard_shows_why_a_job_is_stalled_beside_its_state(run) -> None:
    api, client, keys = run
    job_id = _submit(api, "train", 2)
    RedisStatus(client, keys).finished(3, "trainer.stop_when_drained", 0, 0)
    reason = api.get(f"/v1/jobs/{job_id}").json()["reason"]
    dom = dump_dom(f"{api.base_url}/#token={TOKEN}", virtual_time_ms=3000)
    jobs = dom.split('id="jobs-body"', 1)[1].split("</table>", 1)[0]
    head = re.findall(r"<th>(.*?)</th>", jobs)
    [row] = [re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", jobs) if "<td>" in tr]
    cells = {name: html.unescape(cell) for name, cell in zip(head, row, strict=True)}
    assert head[head.index("state") + 1] == "reason", head
    assert (cells["state"], cells["reason"]) == ("stalled", reason), cells
