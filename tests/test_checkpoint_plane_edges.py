"""Edges of the checkpoint plane with the real pusher against real receivers on 127.0.0.1: what a server says of
itself that the pusher cannot use fails that server's push, named and counted, never hangs the round; a version is
published only when as many distinct servers as the quorum asks committed it, and counts as committed only with
the weights pushed. Engines are SGLang-shaped stubs (``test_engine_client.sglang_056_stub``) or a refused port where
no Commit is reached."""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from net_helpers import refused_port
from pydantic import SecretStr
from receiver_helpers import started_receiver
from safetensors.torch import load_file
from test_engine_client import serve, sglang_056_stub
from transformers import AutoModelForCausalLM

from core.checkpoint_format import MODEL_WEIGHTS
from core.config import CheckpointConfig
from rollout_server.checkpoint_receiver import CheckpointReceiver
from rollout_server.engine_client import EngineClient
from trainer.checkpoint_pusher import CheckpointPusher, Target

WAIT_S = 60.0


@pytest.mark.parametrize("dtype", ["float8_e8m0fnu", "posit16"], ids=["torch-dtype", "no-torch-dtype"])
def test_a_served_dtype_the_pusher_cannot_push_fails_that_push_at_connect(tiny_model_dir: Path, tmp_path: Path,
                                                                          dtype: str) -> None:
    """A receiver whose Status lists a tensor in a dtype this pusher has no wire format for (one of another
    release). A dtype torch lacks used to end the link's thread with an uncaught AttributeError: the round never
    finished (``wait`` hung), ``flush`` reported the server busy for ever and no later version reached it. A torch
    dtype pushes do not support failed inside gRPC's request thread, reported as the stage port's connection
    ``unavailable`` (and retried), not as the dtype. Now either fails at stage ``connect`` naming the tensor and
    the dtype, counted, and the link goes on: the next version fails the same way."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    async def run() -> None:
        with refused_port() as port:  # no engine: these pushes fail before any Commit
            async with started_receiver(cfg, tiny_model_dir, f"http://127.0.0.1:{port}", "newer") as rec:
                name, (_, shape) = next(iter(rec.service.served.items()))
                rec.service.served[name] = (dtype, shape)
                pusher = CheckpointPusher(cfg, [rec.address])
                try:
                    for version in (1, 2):
                        rnd = await asyncio.to_thread(lambda v=version: pusher.push_model(model, v).wait(WAIT_S))
                        [result] = rnd.servers
                        assert (result.stage, result.reason) == ("connect", "dtype"), result
                        assert f"tensor {name} in dtype '{dtype}'" in result.error
                        assert rec.address in result.error
                    assert await asyncio.to_thread(pusher.flush, WAIT_S) == []
                    assert pusher.metrics.registry.get_sample_value(
                        "rollwave_trainer_push_failures_total", {"stage": "connect", "reason": "dtype"}) == 2
                finally:
                    await asyncio.to_thread(pusher.close)
                assert rec.version == 0

    asyncio.run(run())


def test_a_server_that_commits_a_version_again_after_a_restart_counts_once_toward_its_quorum(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """``quorum: all`` of two servers, one of them dead. The live one commits version 1, restarts (a new
    incarnation under its id and address, back on its base weights) and is caught up with version 1 again: its
    second commit used to count as a second server's, so version 1 was published though the dead server never
    had it. A server counts once, however often it commits."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=2.0, retries=0, quorum="all")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        with refused_port() as dead:
            async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
                rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "live")
                address = await rec.start()
                live = [Target("live", address, started=1.0), Target("dead", f"127.0.0.1:{dead}", started=1.0)]
                pusher = CheckpointPusher(cfg, lambda: list(live))
                try:
                    rnd = await asyncio.to_thread(lambda: pusher.push_model(model, 1).wait(WAIT_S))
                    assert [(s.server_id, s.ok) for s in rnd.servers] == [("live", True), ("dead", False)]
                    pusher.take_results()
                    await rec.stop()
                    rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "live",
                                             port=int(address.rsplit(":", 1)[1]))
                    await rec.start()
                    live[0] = Target("live", address, started=2.0)
                    await eventually(lambda: any(r.ok and r.server_id == "live" for r in pusher.take_results()),
                                     "the restarted server to commit version 1 again")
                    await asyncio.to_thread(pusher.flush, WAIT_S)
                    assert rec.version == 1
                    assert (rnd.commits, rnd.published, pusher.published) == (1, False, 0)
                finally:
                    await asyncio.to_thread(pusher.close)
                    await rec.stop()

    asyncio.run(run())



def test_a_version_pushed_again_with_other_weights_is_refused_not_counted_as_served(tiny_model_dir: Path,
                                                                                    tmp_path: Path) -> None:
    """Version 1 committed, then version 1 pushed again with other weights: the pusher used to see the server
    serving version 1 and count the push committed (no byte sent, the round ok, the version published), while the
    server served the first weights. Now only a Commit of the same snapshot that outlived its deadline counts that
    way; the other weights are staged and refused by the server (its version is not newer), named and counted."""
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=5.0, retries=0)
    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)

    async def run() -> None:
        app, _, _ = sglang_056_stub()
        async with serve(app) as url, EngineClient(url, backoff_s=0.05) as engine:
            rec = CheckpointReceiver(cfg, tiny_model_dir, engine, url, "server")
            pusher = CheckpointPusher(cfg, [await rec.start()])
            try:
                assert (await asyncio.to_thread(lambda: pusher.push_model(first, 1).wait(WAIT_S))).ok
                again = await asyncio.to_thread(lambda: pusher.push_model(other, 1).wait(WAIT_S))
                [result] = again.servers
                assert (result.ok, result.stage, result.reason) == (False, "stage", "version"), result
                assert "version 1 is not newer than the served version 1" in result.error
                assert rec.address in result.error
                assert pusher.metrics.registry.get_sample_value(
                    "rollwave_trainer_push_failures_total", {"stage": "stage", "reason": "version"}) == 1
                served = load_file(rec.service._state.current_dir / MODEL_WEIGHTS)
                assert all(torch.equal(served[n], t) for n, t in first.named_parameters())
            finally:
                await asyncio.to_thread(pusher.close)
                await rec.stop()

    asyncio.run(run())


def test_a_version_pushed_again_while_its_round_runs_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Version 1 pushed while its first round still ran (its one server silent: a port that never answers the
    handshake) replaced that round: a wait on the first never ended, and its push's result went to the second. The
    second push is refused at once, naming the version; the first round ends on its own."""
    # the first round outlasts its 1 s connect deadline; the second push, at once, is refused before it snapshots
    cfg = CheckpointConfig(token=SecretStr(secrets.token_urlsafe(32)), stage_dir=tmp_path / "stage",
                           connect_timeout_s=1.0, retries=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts: no handshake comes back
        pusher = CheckpointPusher(cfg, [f"127.0.0.1:{silent.getsockname()[1]}"])
        try:
            first = pusher.push_model(model, 1)
            with pytest.raises(ValueError, match="version 1 is being pushed already"):
                pusher.push_model(model, 1)
            [result] = first.wait(WAIT_S).servers
            assert not result.ok, result
        finally:
            pusher.close()


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    """Poll until ``predicate()``; fail naming ``what`` if it never holds (a hang guard, not a timing check)."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await asyncio.sleep(0.02)
