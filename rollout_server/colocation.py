"""The rollout server's side of a colocated run (``placement.mode=colocated``, see ``buffer.colocation``).

When the trainer takes the device, the engines pause (retracting what runs), release their weights and KV,
and the server reports it. When the trainer gives the device back, the engines resume their weights, load the
ones the trainer wrote (a local push: a directory on this host, no gRPC), resume the rest and continue; the
server then serves that version, so staleness admission opens the next batch. The engines never continue
while released (the embedded engine refuses to), so nothing is generated during training. With the one-step
overlap the trainer never takes the device: the engines keep generating and only pause around each load.

What the engines hold released is recorded in Redis before each release or resume is asked for (a call the
server dies in still completes on the engine): a restarted server starts from that record, because SGLang cannot
be asked and dies resuming memory it holds or releasing it twice, and a load into released memory is refused.
A release that fails is logged and counted, and never reported to the trainer; the engines' answer to it puts the
record back, so a restarted server does not report it either.
A hand-over whose directory does not exist (a tmpfs emptied by a reboot) is not loaded until it does, or the
trainer hands over others; it is logged and counted once, as each warning of engines released too long is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from buffer.colocation import POLL_S, DeviceTurns, Turn
from rollout_server.engine_client import EngineError, EngineGroup
from rollout_server.metrics import RolloutMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")
REST = ["kv_cache", "cuda_graph"]
TAGS = ["weights", *REST]


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
        self.urls = [e.base_url for e in engines.engines]
        self.released: list[str] = []  # the memory tags the engines hold released
        self.handled: Turn | None = None  # the trainer's last turn they were released for
        self.missing: Turn | None = None  # the last turn handed over whose weights were not on disk (logged once)

    async def run(self) -> None:
        self.released = await self._call(self.turns.engines_released, self.urls)
        if not self.released:  # a server that died between a pause and the release or load left them paused
            await self.engines.resume()
        since = time.monotonic()
        while True:
            turn = await self._call(self.turns.turn)
            if turn is not None and turn.holder == "trainer" and turn != self.handled:
                await self.release(turn)
                since = time.monotonic()
            elif turn is not None and turn.holder == "rollout" and (
                self.released or turn.version > self._served()
            ):
                if await self._call(os.path.isdir, turn.path):
                    await self.take_back(turn)
                elif turn != self.missing:
                    self.skip_missing(turn)
            elif self.released and time.monotonic() - since > self.warn_after_s:
                self.metrics.device_handovers.labels(event="overdue").inc()
                log.warning("engines released for %.0f s: the trainer has not given the device back (its turn %s)",
                            time.monotonic() - since, self.handled.key if self.handled else "unknown")
                since = time.monotonic()
            await asyncio.sleep(POLL_S)

    async def release(self, turn: Turn) -> None:
        """Pause and release what the engines still hold (all of it, unless a restart found some released)."""
        if not self.released:
            await self.engines.pause("retract")
        missing = [t for t in TAGS if t not in self.released]
        if missing:
            held = self.released
            await self._record(TAGS)
            try:
                await self.engines.release_memory(missing)
            except EngineError as exc:
                await self._release_failed(turn, held, exc)
                raise
        self.handled = turn
        await self._call(self.turns.released, self.server_id, turn)
        self.metrics.device_handovers.labels(event="release").inc()
        log.info("engines released for trainer step %d (epoch %d)", turn.step, turn.epoch)

    async def _release_failed(self, turn: Turn, held: list[str], exc: EngineError) -> None:
        """The release failed: no report is made, so the trainer never trains on memory the engines may hold. An
        engine that answered the failure holds its memory still: the record goes back to ``held``, so a restarted
        server releases again rather than reporting, unasked, a release that never happened. Without an answer the
        call may yet complete on the engine, and the record stays."""
        self.metrics.device_handovers.labels(event="release_failed").inc()
        log.error("the engines' release for trainer step %d (epoch %d) failed, not reported: %s", turn.step,
                  turn.epoch, exc)
        if exc.status is not None:
            await self._record(held)

    def skip_missing(self, turn: Turn) -> None:
        """A hand-over whose weights are gone (a tmpfs emptied by a reboot, the stage directory of an earlier run
        removed): the load would fail, and so would the server's every restart, until the launcher gave it up. The
        engines stay as they are (released, or serving what they serve) until the weights exist, or the trainer hands
        over others, as every trainer start does."""
        self.missing = turn
        self.metrics.device_handovers.labels(event="missing").inc()
        log.warning("the trainer's hand-over of version %d (epoch %d, step %d) names %s, which does not exist: not "
                    "loaded; waiting for it, or the trainer's next hand-over", turn.version, turn.epoch, turn.step,
                    turn.path)

    async def take_back(self, turn: Turn) -> None:
        """Resume and load ``turn``'s weights (SGLang's order: weights, load, the rest), then continue; a server
        not released (the overlap; or it missed the turn, or just started) only pauses around the load."""
        if not self.released:
            await self.engines.pause(self.swap_pause)
        elif "weights" in self.released:
            await self._record([t for t in self.released if t != "weights"])
            await self.engines.resume_memory(["weights"])
        await self.engines.update_weights_from_disk(turn.path, str(turn.version))
        if rest := self.released:
            await self._record([])
            await self.engines.resume_memory(rest)
        await self.engines.resume()
        await self._call(self.turns.resumed, self.server_id)
        self._serve(turn.version)
        self.metrics.device_handovers.labels(event="resume").inc()
        log.info("engines resumed serving version %d from %s", turn.version, turn.path)

    async def _record(self, tags: list[str]) -> None:
        """The engines hold ``tags`` released once the call that follows is made (recorded first: see above)."""
        await self._call(self.turns.record_engines, self.urls, tags)
        self.released = tags
