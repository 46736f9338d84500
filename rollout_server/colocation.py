"""The rollout server's side of a colocated run (``placement.mode=colocated``, see ``buffer.colocation``).

When the trainer takes the device, the engines pause (retracting what runs), release their weights and KV,
and the server reports it. When the trainer gives the device back, the engines resume their weights, load the
ones the trainer wrote (a local push: a directory on this host, no gRPC), resume the rest and continue; the
server then serves that version, so staleness admission opens the next batch. The engines never continue
while released (the embedded engine refuses to), so nothing is generated during training. With the one-step
overlap the trainer never takes the device: the engines keep generating and only pause around each load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from buffer.colocation import POLL_S, DeviceTurns, Turn
from rollout_server.engine_client import EngineGroup
from rollout_server.metrics import RolloutMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
REST = ["kv_cache", "cuda_graph"]


class EngineTurns:
    """Follows the run's turn in Redis and hands this server's engines over; ``await run()`` until cancelled."""

    def __init__(
        self,
        turns: DeviceTurns,
        engines: EngineGroup,
        server_id: str,
        served: Callable[[], int],
        serve: Callable[[int], None],
        call: Callable[..., Awaitable[Any]],
        metrics: RolloutMetrics,
        warn_after_s: float,
        swap_pause: str = "retract",
    ) -> None:
        self.turns = turns
        self.engines = engines
        self.server_id = server_id
        self._served = served
        self._serve = serve
        self._call = call
        self.metrics = metrics
        self.warn_after_s = warn_after_s
        self.swap_pause = swap_pause  # around a load while the engines hold their memory (checkpoint.kv_on_swap)
        self.released_for: int | None = None  # the trainer step the engines are released for

    async def run(self) -> None:
        handled: int | None = None
        since = time.monotonic()
        while True:
            turn = await self._call(self.turns.turn)
            if turn is not None and turn.holder == "trainer" and handled != turn.step:
                await self.release(turn.step)
                handled, since = turn.step, time.monotonic()
            elif turn is not None and turn.holder == "rollout" and (
                self.released_for is not None or turn.version > self._served()
            ):
                await self.take_back(turn)
            elif self.released_for is not None and time.monotonic() - since > self.warn_after_s:
                log.warning("engines released for %.0f s: the trainer has not given the device back after step %d",
                            time.monotonic() - since, self.released_for)
                since = time.monotonic()
            await asyncio.sleep(POLL_S)

    async def release(self, step: int) -> None:
        await self.engines.pause("retract")
        await self.engines.release_memory()
        self.released_for = step
        await self._call(self.turns.released, self.server_id, step)
        self.metrics.device_handovers.labels(event="release").inc()
        log.info("engines released for trainer step %d", step)

    async def take_back(self, turn: Turn) -> None:
        """Resume and load ``turn``'s weights (SGLang's order: weights, load, the rest), then continue; a server
        not released (the overlap; or it missed the turn, or just started) only pauses around the load."""
        released = self.released_for is not None
        if released:
            await self.engines.resume_memory(["weights"])
        else:
            await self.engines.pause(self.swap_pause)
        await self.engines.update_weights_from_disk(turn.path, str(turn.version))
        if released:
            await self.engines.resume_memory(REST)
        await self.engines.resume()
        self.released_for = None
        self._serve(turn.version)
        self.metrics.device_handovers.labels(event="resume").inc()
        log.info("engines resumed serving version %d from %s", turn.version, turn.path)
