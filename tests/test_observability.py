"""Observability: every label of a component's metrics has a bounded set of values, the Grafana panels group and
filter by labels their metrics have, the API's built-in dashboard charts series that exist, and failures that were
only logged are counted, each read back from the registry of the real component that failed."""

from __future__ import annotations

import asyncio
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import client
from prometheus_harness import load_dashboard, panel_queries
from test_rollout_worker_stub_engine import KEYS, StubEngine, held, make_worker, running, stub, until
from trainer_helpers import synthetic_groups

from buffer.metrics import BufferMetrics
from buffer.redis_server import EmbeddedRedis
from buffer.task_queue import TaskQueue
from core.config import BufferConfig, TrainerConfig
from core.tasks import load_tasks
from rollout_server.checkpoint_receiver import CheckpointMetrics
from rollout_server.engine.metrics import EngineMetrics
from rollout_server.metrics import RolloutMetrics
from services.api.sampler import SERIES
from trainer.checkpoint_pusher import PushMetrics
from trainer.metrics import TrainerMetrics
from trainer.parallel import DistContext
from trainer.worker import Trainer

STATIC = Path(__file__).resolve().parents[1] / "services" / "static"
COMPONENTS = (RolloutMetrics, CheckpointMetrics, EngineMetrics, BufferMetrics, TrainerMetrics, PushMetrics)
# a label holding one of these takes a new value per server, process, request, task or peer: a series without bound
UNBOUNDED = {"server", "server_id", "consumer", "instance_id", "host", "peer", "url", "path", "id", "rid", "job_id",
             "group_id", "task_id", "error", "message"}
__all__ = ["stub"]  # the stub engine's fixture, used by name
SCRAPE_LABELS = {"instance", "job", "profile", "engine", "le"}  # added by Prometheus (prometheus.yml) or a histogram


def _label_names() -> dict[str, set[str]]:
    """Metric family name -> its label names, for every metric the components register."""
    return {collector._name: set(collector._labelnames)  # a family's labels, before any series is set
            for cls in COMPONENTS for collector in cls().registry._collector_to_names}


def test_no_metric_labels_a_series_by_an_unbounded_value() -> None:
    """An ``*_info`` gauge is exempt: it holds one series, the value served now (``EngineMetrics.set_version``)."""
    bad = {name: sorted(labels & UNBOUNDED) for name, labels in _label_names().items()
           if labels & UNBOUNDED and not name.endswith("_info")}
    assert bad == {}


def test_dashboard_panels_group_and_filter_by_labels_their_metrics_have() -> None:
    labels = _label_names()
    family = re.compile(r"\b(rollwave_[a-z0-9_]+?)(?:_total|_bucket|_sum|_count)?\b")
    grouping = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
    matcher = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
    bad = []
    for query in panel_queries(load_dashboard()):
        metrics = [m for m in family.findall(query) if m in labels]
        assert metrics, f"no metric a component registers in {query}"
        used = {n.strip() for g in grouping.findall(query) for n in g.split(",") if n.strip()}
        used |= set(matcher.findall(query))
        have = set().union(*(labels[m] for m in metrics)) | SCRAPE_LABELS
        bad += [f"{query}: {name}" for name in sorted(used - have)]
    assert bad == []


@pytest.mark.parametrize(("fault", "reason", "logged"), [
    ("tool", "error", " failed: ValueError: task {gid}: unknown tool 'no_such_tool'"),
    ("engine", "episodes", ": 1 of 1 episodes failed; first: "),
], ids=["error", "episodes"])
def test_a_failed_task_attempt_is_counted_by_reason(
    redis_server: EmbeddedRedis, stub: StubEngine, tokenizer: Any, caplog: pytest.LogCaptureFixture,
    fault: str, reason: str, logged: str,
) -> None:
    """A task naming a tool this server lacks raises in the rollout (error); an engine answering HTTP 500 fails the
    group's episodes (episodes). Each attempt fails the task back to the queue with the error, logged and counted,
    until ``buffer.max_attempts`` (2) dead-letter it."""
    r = client(redis_server)
    q = TaskQueue(r, KEYS, BufferConfig())
    q.ensure_groups()
    [task] = load_tasks("arith", split="test", limit=1)
    tools = ["no_such_tool"] if fault == "tool" else task.tools
    [gid] = q.submit("job", [{**task.model_dump(mode="json"), "tools": tools}], "eval")
    if fault == "engine":
        stub.generate_open.set()
    worker = make_worker(redis_server, stub, tokenizer, grace_s=5, buffer=BufferConfig(max_attempts=2))

    async def scenario() -> None:
        async with running(worker) as serving:
            await until(lambda: r.xlen(KEYS.tasks_dead) == 1, serving, "the task is dead-lettered")

    with caplog.at_level(logging.WARNING, logger="rollout_server.worker"):
        asyncio.run(scenario())
    assert caplog.text.count(f"group {gid}" + logged.format(gid=gid)) == 2
    failed = "rollwave_rollout_tasks_failed_total"
    assert {k: worker.metrics.total(failed, reason=k) for k in ("error", "episodes")} == {
        k: 2 if k == reason else 0 for k in ("error", "episodes")}
    assert worker.buffer_metrics.registry.get_sample_value("rollwave_buffer_dead_letters_total") == 1
    assert held(r, "eval") == []


def test_a_skipped_policy_update_is_counted(ctx: DistContext, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A reward beyond fp32's range (its advantage, unnormalised, overflows) makes the second minibatch's gradient
    NaN: its update is skipped, and counted."""
    groups = synthetic_groups(0, 2)
    groups[1].samples[0].reward = 1e39
    cfg = TrainerConfig(lr=1e-3, micro_batch_tokens=96, kl_coef=0.0, ppo_minibatches=2, std_norm=False,
                        device="cpu")
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "policy").start(ctx=ctx)
    try:
        record = trainer.train(groups)
    finally:
        trainer.close()
    assert record["skipped_updates"] == 1 and math.isnan(record["grad_norm"])
    assert trainer.metrics.registry.get_sample_value("rollwave_trainer_skipped_updates_total") == 1


def test_the_built_in_dashboard_charts_series_the_components_record() -> None:
    """Each chart of the API's page is a series the sampler serves, and each rollout counter the sampler reads
    through the heartbeat's ``stats`` moves when the component records: a renamed metric would chart 0."""
    charts = set(re.findall(r'data-series="([a-z_]+)"', (STATIC / "index.html").read_text()))
    assert charts == set(SERIES)
    metrics = RolloutMetrics()
    checkpoint = CheckpointMetrics(metrics.registry)  # as rollout_server.__main__ shares the server's registry
    metrics.generated_tokens.inc(5)
    metrics.tool_calls.labels(tool="calculator", outcome="ok").inc()
    metrics.tool_calls.labels(tool="calculator", outcome="timeout").inc(2)
    checkpoint.pause_seconds.observe(0.25)
    checkpoint.paused_seconds.inc(0.25)
    stats = metrics.stats()
    assert {k: stats[k] for k in ("generated_tokens", "tool_errors", "pauses", "pause_s", "paused_s")} == {
        "generated_tokens": 5, "tool_errors": 2, "pauses": 1, "pause_s": 0.25, "paused_s": 0.25}
