"""The rollout worker: tasks from Redis -> agent loop -> trajectory groups into the replay buffer.

Up to ``max_concurrent_groups`` train groups and ``max_concurrent_eval_groups`` eval groups run at once. A
train task starts only once staleness admission lets it; its group is written and the task acked in one atomic
step, so a task is never acked without its group and never makes two. The worker heart-beats into the server
registry and renews the leases of the tasks it holds, so only a dead worker's tasks are reclaimed by others.

On ``stop()`` (SIGTERM) it reads no more, lets in-flight groups finish for ``shutdown_grace_s``, then
hands the rest back to the queue unacked; nothing it held is lost. The checkpoint receiver runs beside
it (``rollout_server.__main__``) and outlives it, so a weight swap never interrupts the drain. A Redis outage is
no longer ridden out once it stops: a Redis that is gone then is said in one line, and the worker exits without
it (its tasks stay pending, for other servers to reclaim once Redis is back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import redis
from pydantic import ValidationError

from buffer.keys import Keys
from buffer.metrics import BufferMetrics
from buffer.redis_server import end_outage_retries
from buffer.registry import ServerInfo, ServerRegistry
from buffer.replay import BufferClosed, GroupTooLarge, ReplayBuffer
from buffer.schema import TrajectoryGroup
from buffer.staleness import LeaseLost, StalenessControl
from buffer.task_queue import TaskEntry, TaskQueue
from core.config import BufferConfig, RolloutConfig
from core.jobs import JobSpec, rollout_settings
from core.tasks import Task
from rollout_server.agent_loop import AgentLoop, PromptTooLong, parse_version
from rollout_server.agent_runner import run_agent, start_fork_server
from rollout_server.engine_client import EngineClient, EngineError
from rollout_server.metrics import RolloutMetrics
from rollout_server.openai_api import FAILED_REASONS, EpisodeStore
from rollout_server.tools import ToolRegistry

log = logging.getLogger(__name__)

T = TypeVar("T")
READ_BLOCK_MS = 500
ADMISSION_POLL_MS = 50  # how long a read waits while only admission keeps train slots empty (room opens at a push)
MAX_CACHED_LOOPS = 64
REDIS_GONE = (redis.ConnectionError, redis.TimeoutError)  # what a stopping worker does not wait out
TRAJECTORY_LOG_LEN = 20_000  # per job, for inspection through the API
# KEYS: job hash, its trajectories stream; ARGV: the stream's bound, then the samples' records. Logged only while the
# job exists: a put that lands after the job was done and deleted (a late duplicate of its group) must not bring back
# a stream of it. Returns -1 when the job is gone, else how many were logged.
_LOG_TRAJECTORIES = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
for i = 2, #ARGV do redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'sample', ARGV[i]) end
return #ARGV - 1
"""


def default_server_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RolloutWorker:
    """One rollout server's loop over the task queue; ``await run()`` until ``stop()``."""

    def __init__(
        self,
        client: redis.Redis,
        run: str,
        rollout: RolloutConfig,
        buffer: BufferConfig,
        engines: list[EngineClient],
        tokenizer: Any,
        tools: ToolRegistry,
        metrics: RolloutMetrics | None = None,
        agent_cpus: list[int] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("the rollout worker needs at least one engine")
        self.run_name = run
        self.config = rollout
        self.agent_cpus = agent_cpus or []  # placement.agent_cpus: where each agent process pins itself
        self.engines = engines
        self.tokenizer = tokenizer
        self.tools = tools
        self.metrics = metrics or RolloutMetrics()
        self.buffer_metrics = BufferMetrics(self.metrics.registry)
        self.keys = Keys(run)
        self.redis = client
        self.tasks = TaskQueue(client, self.keys, buffer, self.buffer_metrics)
        self.replay = ReplayBuffer(client, self.keys, buffer, metrics=self.buffer_metrics)
        self.staleness = StalenessControl(client, self.keys, buffer, self.buffer_metrics)
        self.servers = ServerRegistry(client, self.keys, ttl_s=3 * rollout.heartbeat_s)
        self._log_samples = client.register_script(_LOG_TRAJECTORIES)
        self.consumer = rollout.server_id or default_server_id()
        self.info = ServerInfo(self.consumer, engine_url=engines[0].base_url)
        self.episodes = EpisodeStore(tokenizer, rollout.openai_model, self.metrics)
        self.lease_s = min(rollout.heartbeat_s, buffer.claim_idle_ms / 3000)
        self._inflight: dict[asyncio.Task, TaskEntry] = {}
        self._unadmitted: set[str] = set()  # train groups read whose admission is not yet settled
        self._loops: dict[tuple[str, int], AgentLoop] = {}
        self._specs: dict[str, JobSpec] = {}  # job id -> its spec, validated (the last MAX_CACHED_LOOPS jobs)
        self._spec_read = asyncio.Lock()
        self._next_engine = 0
        self.engine_down: str | None = None  # why the worker stopped itself: an engine stopped answering (_engines_up)
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(
            rollout.max_concurrent_groups + rollout.max_concurrent_eval_groups + 4, thread_name_prefix="redis"
        )

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a (blocking) Redis call off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def stop(self) -> None:
        """Ask the worker to shut down gracefully (safe from a signal handler); Redis calls fail at once from now
        on rather than wait out an outage."""
        self._stopping.set()
        end_outage_retries(self.redis)

    async def run(self) -> None:
        """Read tasks while slots are free and run each group as its own asyncio task, until ``stop()``."""
        await self._start()
        beat = asyncio.create_task(self._heartbeat_loop())
        try:
            try:
                await self._serve()
            except REDIS_GONE:
                if not self._stopping.is_set():
                    raise  # Redis gone under a shutdown: said once, in _close
            await self._drain()
        finally:
            beat.cancel()
            await self._close()

    async def _serve(self) -> None:
        """The loop of ``run``: take tasks into free slots until ``stop()``."""
        while not self._stopping.is_set():
            wanted, shut_slots = await self._free_slots()
            wait_ms = ADMISSION_POLL_MS if shut_slots else READ_BLOCK_MS
            entries: list[TaskEntry] = []
            if shut_slots:  # a dead server's admitted tasks may hold the whole window: taking them over opens it
                entries += await self._call(self.tasks.reclaim, self.consumer, shut_slots, "train")
            idle = not self._inflight  # eval slots are free then, so something is wanted
            for i, (kind, count) in enumerate(wanted):
                block = wait_ms if idle and i == len(wanted) - 1 and not entries else 0
                entries += await self._call(self.tasks.read, self.consumer, count, block, (kind,))
            if not entries and self._inflight:  # a group that ends frees a slot: wait on that, not in a read
                await asyncio.wait(list(self._inflight), timeout=wait_ms / 1000,
                                   return_when=asyncio.FIRST_COMPLETED)
            working = {e.entry_id for e in self._inflight.values()}
            for entry in entries:
                if entry.entry_id in working:  # its renewal came late and the own rescan took it: still ours
                    continue
                if entry.kind == "train":
                    self._unadmitted.add(entry.group_id)
                task = asyncio.create_task(self._handle(entry), name=f"group {entry.group_id}")
                self._inflight[task] = entry
                task.add_done_callback(self._inflight.pop)

    async def _free_slots(self) -> tuple[list[tuple[str, int]], int]:
        """(kind, how many to read), eval first, train no more than staleness admission has room for; and how
        many train slots admission alone keeps empty. A task read beyond that room would wait here for
        admission, out of reach of a server that could start it sooner. Eval groups have their own limit:
        they are usually one greedy sample each."""
        n_eval = sum(1 for e in self._inflight.values() if e.kind == "eval")
        free = [("eval", self.config.max_concurrent_eval_groups - n_eval)]
        free_train = self.config.max_concurrent_groups - (len(self._inflight) - n_eval)
        room = 0
        if free_train > 0:  # the groups read and not yet admitted will take some of it
            room = max(0, await self._call(self.staleness.capacity, self.info.version) - len(self._unadmitted))
        free.append(("train", min(free_train, room)))
        return [(kind, n) for kind, n in free if n > 0], free_train if free_train > 0 and room == 0 else 0

    async def _start(self) -> None:
        await self._call(self.tasks.ensure_groups)
        await self._call(self.replay.ensure_group)
        self.info.version = await self._engine_version("start")
        if self.config.agent_allowlist:
            await start_fork_server(self.config.agent_allowlist)
        await self._call(self.servers.register, self.info)
        log.info("rollout worker %s serving run %s with %d engine(s)", self.consumer, self.run_name,
                 len(self.engines))

    async def _handle(self, entry: TaskEntry) -> None:
        """One task -> one group written (or the task handed back, failed or dead-lettered, never lost; or left to the
        server that took it over while this one was frozen past its lease). A group with a failed episode is not
        written: the task fails and is rolled out again (``buffer.max_attempts``)."""
        try:
            if await self._call(self.tasks.job_state, entry.job_id) == "cancelled":  # acked and counted, not
                await self._call(self.tasks.cancel, entry)  # dead-lettered: it did not fail
                return
            spec = await self._job_spec(entry.job_id)
            loop = self._agent_loop(entry.job_id, spec)
            task = Task.model_validate({**entry.task, "task_id": entry.group_id})
            if spec is not None and spec.tools is not None:
                task = task.model_copy(update={"tools": spec.tools})
            if spec is not None and spec.agent is not None:
                self._check_agent(spec.agent)
            if entry.kind == "train":
                admitted = await self._call(self.staleness.admit, entry.group_id, self._stopping, None,
                                            lambda: self.info.version,
                                            lambda: self.tasks.job_state(entry.job_id) == "cancelled", entry)
                self._unadmitted.discard(entry.group_id)
                if not admitted and self._stopping.is_set():
                    await self._hand_back(entry, "stopped_awaiting_admission", "the server stopped while it waited "
                                          "for staleness admission")
                    return
                if not admitted:  # its job was cancelled while it waited (once a run's trainer finished, for good)
                    await self._call(self.tasks.cancel, entry)
                    return
            with self.metrics.generating():
                if spec is not None and spec.agent is not None:
                    group = await self._agent_group(spec.agent, loop, task, entry)
                else:
                    group = await loop.run_group(task, run=self.run_name, job_id=entry.job_id)
            group.kind = entry.kind
            failed = [s for s in group.samples if s.failed]
            if failed and self._stopping.is_set() and any(s.finish_reason in ("error", "abort") for s in failed):
                await self._hand_back(entry, "failed_while_stopping", f"{len(failed)} of {len(group.samples)} "
                                      "episodes failed while the server was stopping (the engine went away under a "
                                      f"shutdown); first: {failed[0].reward_info.get('error')}")
                return
            if failed and any(s.finish_reason in ("error", "abort") for s in failed) and not await self._engines_up():
                await self._hand_back(entry, "engine_down", f"{len(failed)} of {len(group.samples)} episodes failed "
                                      f"on an engine that is down; first: {failed[0].reward_info.get('error')}")
                return
            if failed:  # no outcome for some samples: never trained as reward 0; rolled out again, or dead-lettered
                first = failed[0].reward_info["error"]
                error = f"{len(failed)} of {len(group.samples)} episodes failed; first: {first}"
                log.warning("group %s: %s", entry.group_id, error)
                await self._fail(entry, "episodes", error)
                return
            await self._put(group, entry)
        except ValidationError as exc:  # a bad task or job spec will not get better: no retries
            await self._dead_letter(entry, "invalid_task", f"invalid task or job spec: {exc}")
        except PermissionError as exc:  # nor will an agent this server does not allow
            await self._dead_letter(entry, "agent_not_allowed", str(exc))
        except PromptTooLong as exc:  # nor a prompt that does not fit the context
            await self._dead_letter(entry, "prompt_too_long", str(exc))
        except GroupTooLarge as exc:  # nor a group longer than Redis takes (its samples' tokens are the job's settings)
            await self._dead_letter(entry, "group_too_large", str(exc))
        except LeaseLost:  # not admitted: another server took the task over, or ended it (logged and counted)
            pass
        except BufferClosed as exc:
            await self._hand_back(entry, "buffer_closed", str(exc))
        except asyncio.CancelledError:
            await self._hand_back(entry, "cancelled", "cancelled before it finished (shutdown_grace_s ran out)")
            raise
        except redis.ConnectionError as exc:
            log.warning("group %s: Redis unreachable (%s); the task stays pending and will be reclaimed",
                        entry.group_id, exc)
        except Exception as exc:  # a task that cannot be rolled out fails with its error; the server goes on
            log.warning("group %s failed: %s: %s", entry.group_id, type(exc).__name__, exc)
            await self._fail(entry, "error", f"{type(exc).__name__}: {exc}")
        finally:
            self._unadmitted.discard(entry.group_id)

    async def _engines_up(self) -> bool:
        """Whether every engine answers ``/health``. One that does not (its process died, a sidecar went away) stops
        this server, once, naming it (``engine_down``; the server then exits 1 and its supervisor restarts it, and
        with it an embedded engine): a task failing on a dead engine would spend its attempts and be
        dead-lettered, and every task this server took after it with it."""
        healthy = await asyncio.gather(*(e.health() for e in self.engines))
        down = [e.base_url for e, ok in zip(self.engines, healthy, strict=True) if not ok]
        if down and self.engine_down is None:
            self.engine_down = f"engine {', '.join(down)} does not answer /health"
            log.error("%s: stopping this server; its tasks are handed back unfailed", self.engine_down)
            self.stop()
        return not down

    async def _fail(self, entry: TaskEntry, reason: str, error: str) -> None:
        """Fail a task's attempt with ``error`` (requeued, dead-lettered once ``buffer.max_attempts`` are spent),
        counted by ``reason``: a failure only logged would go unseen until the task is dead-lettered."""
        self.metrics.tasks_failed.labels(reason=reason).inc()
        await self._call(self.tasks.fail, entry, error)

    async def _dead_letter(self, entry: TaskEntry, reason: str, error: str) -> None:
        """Dead-letter a task that every attempt would fail the same way, without retries; counted by ``reason``
        (the queue logs it with ``error``). Not counted when another worker ended the task meanwhile."""
        if await self._call(self.tasks.dead_letter, entry, error):
            self.metrics.tasks_dead_lettered.labels(reason=reason).inc()

    async def _hand_back(self, entry: TaskEntry, reason: str, why: str) -> None:
        """Requeue a task unacked, dropping any group it made; logged and counted by ``reason``, so work given
        back (and rolled out again by some server) is seen, not silently lost time. Not counted when the task was no
        longer this worker's (it lost its lease; the queue logs that)."""
        if await self._call(self.tasks.hand_back, entry):
            log.warning("group %s: %s; its task is handed back", entry.group_id, why)
            self.metrics.tasks_handed_back.labels(reason=reason).inc()

    async def _put(self, group: Any, entry: TaskEntry) -> None:
        """Write the group and ack its task, then log its samples for reading back through the API (not those of
        a group the buffer refused because another worker ended its task meanwhile, nor of a job deleted since).
        Rides out a Redis restart (the put is idempotent)."""
        delay = 0.5
        while True:
            try:
                if await self._call(self.replay.put, group, entry):
                    await self._call(self._log_trajectories, group)
                return
            except redis.ConnectionError as exc:
                if self._stopping.is_set():
                    raise
                log.warning("group %s: Redis unreachable (%s); retrying the put", group.group_id, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)

    def _log_trajectories(self, group: Any) -> None:
        records = [json.dumps({
            "group_id": group.group_id, "sample_index": sample.sample_index, "reward": sample.reward,
            "reward_info": sample.reward_info, "finish_reason": sample.finish_reason,
            "num_turns": sample.num_turns, "messages": sample.messages,
            "tool_calls": [vars(t) for t in sample.tool_calls], "num_tokens": int(sample.token_ids.size),
            "num_generated": sample.num_generated,
        }, default=str) for sample in group.samples]
        keys = [self.keys.job(group.job_id), self.keys.trajectories(group.job_id)]
        if self._log_samples(keys, [TRAJECTORY_LOG_LEN, *records]) == -1:
            log.info("group %s: job %s is deleted; its samples are not logged", group.group_id, group.job_id)

    async def _job_spec(self, job_id: str) -> JobSpec | None:
        """The job's spec, read and validated once per job (a job's spec never changes once stored): an inline job's
        spec holds its tasks, up to ``MAX_INLINE_TASKS``, and reading and validating it for each of them cost the
        server seconds a task. None for a job stored without one (read again next time)."""
        async with self._spec_read:  # the groups a job starts at once wait for one read
            if (spec := self._specs.get(job_id)) is None:
                stored = (await self._call(self.tasks.job, job_id)).get("spec")
                if not stored:
                    return None
                spec = JobSpec.model_validate_json(stored)
                if len(self._specs) >= MAX_CACHED_LOOPS:
                    self._specs.pop(next(iter(self._specs)))
                self._specs[job_id] = spec
        return spec

    def _agent_loop(self, job_id: str, spec: JobSpec | None) -> AgentLoop:
        """The agent loop with a job's settings on the next engine (round robin). Cached per job and engine."""
        engine_index = self._next_engine % len(self.engines)
        self._next_engine += 1
        key = (job_id, engine_index)
        if key not in self._loops:
            config = rollout_settings(spec, self.config) if spec else self.config
            if len(self._loops) >= MAX_CACHED_LOOPS:
                self._loops.pop(next(iter(self._loops)))
            self._loops[key] = AgentLoop(
                self.engines[engine_index], self.tokenizer, self.tools, config, metrics=self.metrics
            )
        return self._loops[key]

    def _check_agent(self, entrypoint: str) -> None:
        """Jobs may only name agents the operator allowed: a job must not choose what code a server runs."""
        if entrypoint not in self.config.agent_allowlist:
            self.metrics.agent_runs.labels(outcome="refused").inc()
            raise PermissionError(f"agent {entrypoint!r} is not in this server's rollout.agent_allowlist")

    async def _agent_group(self, entrypoint: str, loop: AgentLoop, task: Task, entry: TaskEntry) -> TrajectoryGroup:
        """The job's agent run once per sample against the episode endpoint. A train group keeps only the
        samples that can be trained (not failed, not edited); an eval group keeps all (failed score 0). An agent
        whose first request does not fit the context fails the task (``PromptTooLong``), as the built-in loop does."""
        queued = time.time()

        async def one(index: int) -> Any:
            ep = self.episodes.open(task, index, loop.config, loop.engine, loop.reward, queued)
            try:
                outcome = await run_agent(entrypoint, task, self.episodes.base_url(ep), ep.key,
                                          timeout_s=self.config.agent_timeout_s,
                                          memory_mb=self.config.agent_memory_mb, cpus=self.agent_cpus,
                                          max_processes=self.config.agent_max_processes)
            except asyncio.CancelledError:
                self.episodes.discard(ep)
                raise
            self.metrics.agent_runs.labels(outcome=outcome.limit or outcome.failure or "ok").inc()
            if outcome.failure is not None:
                log.warning("group %s sample %d: %s", entry.group_id, index, outcome.error)
                self.episodes.fail(ep, outcome.failure, outcome.error)
            elif outcome.reward is not None and ep.reward is None:
                ep.reward = (outcome.reward, {"source": "agent"})
            return await self.episodes.close(ep)

        samples = list(await asyncio.gather(*(one(i) for i in range(loop.config.n_samples))))
        too_long = next((s for s in samples if s.finish_reason == "prompt_too_long"), None)
        if too_long is not None:  # as the built-in loop's: the task is bad input, in a train or an eval job
            raise PromptTooLong(too_long.reward_info["error"])
        if entry.kind == "train":
            for sample in samples:
                if sample.finish_reason in FAILED_REASONS:
                    self.metrics.samples_excluded.labels(reason=sample.finish_reason).inc()
            kept = [s for s in samples if s.finish_reason not in FAILED_REASONS]
            if not kept:
                raise RuntimeError(f"all {len(samples)} agent samples failed; first: "
                                   f"{samples[0].reward_info.get('error')}")
            samples = kept
        self.metrics.groups_completed.inc()
        return TrajectoryGroup(run=self.run_name, job_id=entry.job_id, task_id=task.task_id, samples=samples,
                               temperature=loop.config.temperature)

    async def _heartbeat_loop(self) -> None:
        """Registry heartbeat, lease renewal of held tasks and buffer gauges, every ``lease_s``.

        The registry entry lives three heartbeats and a lease ``claim_idle_ms`` (at least three ``lease_s``), while
        an engine call may take ``engine.request_timeout_s`` (minutes): a beat that waited that long on an engine
        which stopped answering let both lapse, and other servers took over tasks still being worked on. So the
        version read gets half a period (the last version known is kept past it), and a beat's own time is taken
        off the wait for the next."""
        clock = asyncio.get_running_loop().time
        beat_at = clock()
        while True:
            await asyncio.sleep(max(0.0, beat_at + self.lease_s - clock()))
            beat_at = clock()
            try:
                self.info.version = await self._engine_version("heartbeat", timeout_s=self.lease_s / 2)
                self.info.stats = self.metrics.stats()
                await self._call(self.servers.heartbeat, self.info)
                lost = await self._call(self.tasks.renew, self.consumer, list(self._inflight.values()))
                for entry in lost:
                    log.warning("group %s: lease lost to another worker; its group may be written twice "
                                "(the buffer keeps one)", entry.group_id)
                await self._call(self.buffer_metrics.observe, self.redis, self.keys)
            except redis.RedisError as exc:
                if not (self._stopping.is_set() and isinstance(exc, REDIS_GONE)):  # _close says that
                    log.warning("heartbeat: %s: %s", type(exc).__name__, exc)

    async def _engine_version(self, stage: str, timeout_s: float | None = None) -> int:
        """The version the first engine serves; the last one known when it cannot be read within ``timeout_s``
        (None: the engine client's own timeout), or is not an integer (logged, naming ``stage``: tokens of such a
        version are refused by the agent loop anyway)."""
        url = self.engines[0].base_url
        try:
            return parse_version(await asyncio.wait_for(self.engines[0].weight_version(), timeout_s))
        except TimeoutError:
            log.warning("%s: the engine %s did not report its weight version within %.3g s; keeping version %d",
                        stage, url, timeout_s, self.info.version)
        except EngineError as exc:
            log.warning("%s: cannot read the weight version of %s: %s", stage, url, exc)
        except ValueError as exc:
            log.error("%s: engine %s: %s", stage, url, exc)
        return self.info.version

    async def _drain(self) -> None:
        """Give in-flight groups ``shutdown_grace_s`` to finish, then hand the rest back."""
        pending = list(self._inflight)
        if pending:
            log.info("stopping: waiting up to %.0fs for %d in-flight group(s)", self.config.shutdown_grace_s,
                     len(pending))
            _done, late = await asyncio.wait(pending, timeout=self.config.shutdown_grace_s)
            self.replay.close()
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    async def _close(self) -> None:
        try:
            await self._call(self.servers.deregister, self.consumer)
        except REDIS_GONE as exc:
            log.warning("stopping without Redis (%s): %s stays registered until its entry expires, and the tasks it "
                        "held are reclaimed by other servers once Redis is back", exc, self.consumer)
        self._pool.shutdown(wait=True)
