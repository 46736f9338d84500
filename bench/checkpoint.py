"""Checkpoint engine benchmark: a ~100M-parameter push, measured side by side in one run.

(a) Commit's pause (pause(retract) -> update_weights_from_disk from tmpfs -> continue, as the
    receiver reports it) against np.copyto of the same number of bytes, both into a warm,
    preallocated buffer and into fresh pages (np.empty each time, so page faults are included).
(b) Stage throughput (pusher in this process -> the receiver's stage port, the default
    ``checkpoint.stage_transport: tcp``, the manifest and trailer over gRPC -> receiver process writing the staged
    safetensors on tmpfs, xxh3 digests on both sides; timed by the receiver, from the manifest to the
    trailer, since the pusher streams in the background) against raw loopback TCP moving the same bytes
    (sendall of 1 MiB slices -> recv_into a reused buffer in another process), in rounds of their own:
    full pushes one after another, as a run makes them (each stage overwrites the served version's
    file; a push after an adapter's finds none and allocates fresh pages). Beside them, in the same rounds, the
    stage with ``stage_transport: grpc`` (the bytes in the Stage call, 1 MiB messages) and, for reference, a
    bare gRPC stream of the same 1 MiB messages into a sink that only counts them.

(c) The commit pause of a LoRA adapter push (``model.lora``: rank ``--lora-rank`` on the attention
    projections; only the adapter travels and the engine loads it by name) against the full push's pause,
    on the same engine and receiver, the two pushes of each round in alternating order.

(d) The generation stall a user sees, with requests in flight: ``--streams`` requests decode without pause
    while full pushes commit, and the engine measures each swap from the last token before the pause to the
    first after it (``rollwave_engine_generation_stall_seconds``; the load, and the re-prefill of the retracted
    requests, included). Three receivers in front of the same engine (``SWAP_MODES``), their pushes in rotating
    order: ``default`` (the defaults: pause retract, the retracted requests' KV computed under the new weights
    before the pause, ``checkpoint.prefill_ahead``), ``reprefill`` (``prefill_ahead: false``: they are prefilled
    again after the swap) and ``keep`` (``kv_on_swap: keep``: pause in_place). The bench reads the engine's
    metrics from 0.25 s after each commit on, not while the engine runs its first steps after the swap: on two
    cores, a scrape every 50 ms there added ~25 ms to each stall it measured. Beside it, the mean decode step in
    a 1 s window after each round (``rollwave_engine_decode_step_seconds``): the time between tokens with no
    push running.

TCP rounds and pushes alternate, so both see the same background load; medians are reported.
The engine is idle during (a)-(c) so neither side competes with decoding for the CPU.
Every process (this one re-executes itself) runs with glibc malloc tuned for large buffers
(MALLOC_ENV); ``--plain-malloc`` keeps stock malloc (but for the engine, which tunes its own at start).
Last line: ``stall_vs_memcpy ratio <value>`` (the stall at the defaults over the warm memcpy), after
``pause_vs_memcpy``, ``lora_pause_vs_full_pause``, ``stall_keep_vs_decode_step``, ``stall_keep_vs_memcpy`` and
``stall_reprefill_vs_memcpy``.

    python bench/checkpoint.py [--pushes 5] [--layers 9] [--lora-rank 16] [--streams 4] [--engine-threads N]
                               [--plain-malloc]
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from core.process import MALLOC_ENV  # noqa: E402

TOKEN = os.environ.setdefault("ROLLWAVE_CHECKPOINT_TOKEN", secrets.token_urlsafe(32))  # children inherit it
SLICE = 1 << 20
# (d): what a swap does to the requests decoding through it, one receiver each (checkpoint.kv_on_swap, prefill_ahead)
SWAP_MODES = {
    "default": {},
    "reprefill": {"kv_on_swap": "recompute", "prefill_ahead": False},
    "keep": {"kv_on_swap": "keep"},
}


def build_model_dir(out: Path, layers: int) -> tuple[Path, int]:
    """A random-init Qwen2 (hidden 1024, MLP 2816, 16/4 heads) with the tiny model's tokenizer; 9 layers is ~102M
    parameters. Returns the directory and the parameter count."""
    from core.tiny_model import save_random_qwen2

    return out, save_random_qwen2(out, layers=layers, hidden=1024, intermediate=2816, heads=16, kv_heads=4)


async def serve_receiver(model: str, engine_url: str, stage_dir: str, mode: str) -> None:
    """Child mode: one checkpoint receiver (a mode of ``SWAP_MODES``) in front of the engine, until stdin closes."""
    from core.config import CheckpointConfig
    from rollout_server.checkpoint_receiver import CheckpointReceiver
    from rollout_server.engine_client import EngineClient

    async with EngineClient(engine_url) as client:
        config = CheckpointConfig(token=TOKEN, stage_dir=Path(stage_dir), **SWAP_MODES[mode])
        receiver = CheckpointReceiver(config, Path(model), client, engine_url, f"bench-{mode}")
        print(await receiver.start(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await receiver.stop()


def tcp_sink(nbytes: int, rounds: int) -> None:
    """Child mode: accept ``rounds`` connections, read ``nbytes`` from each, answer one byte."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        buf = memoryview(bytearray(SLICE))
        for _ in range(rounds):
            conn, _ = server.accept()
            with conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(buf)
                    if n == 0:
                        raise ConnectionError(f"sender closed after {got} of {nbytes} bytes")
                    got += n
                conn.sendall(b"k")


def grpc_sink() -> None:
    """Child mode: a gRPC server whose streaming method only counts the bytes it receives."""
    import grpc

    from core.checkpoint_format import GRPC_OPTIONS

    def count(messages: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return sum(len(m) for m in messages).to_bytes(8, "little")

    server = grpc.server(ThreadPoolExecutor(2), options=GRPC_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(count)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Sink", {"Count": handler}),))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    sys.stdin.read()
    server.stop(1).wait()


def raw_grpc_seconds(address: str, src: np.ndarray) -> float:
    import grpc

    from core.checkpoint_format import GRPC_OPTIONS

    view = memoryview(src).cast("B")
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        count = channel.stream_unary("/bench.Sink/Count")
        start = time.perf_counter()
        count(bytes(view[off:off + SLICE]) for off in range(0, len(view), SLICE))
        return time.perf_counter() - start


def child(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start this script in a child mode; returns the process and the first line it prints."""
    proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"child {args[0]} exited with {proc.wait()} before it was ready")
    return proc, line


def raw_tcp_seconds(port: int, src: np.ndarray) -> float:
    view = memoryview(src).cast("B")
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for off in range(0, len(view), SLICE):
            sock.sendall(view[off:off + SLICE])
        if sock.recv(1) != b"k":
            raise ConnectionError("TCP sink did not acknowledge")
    return time.perf_counter() - start


def memcpy_seconds(src: np.ndarray, warm: bool, repeats: int = 5) -> float:
    """Best of ``repeats``: into one preallocated, touched buffer (warm), or into a new anonymous
    mapping each time (fresh pages: every page is faulted in and zeroed during the copy)."""
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        fresh = None if warm else mmap.mmap(-1, src.nbytes)
        target = dst if fresh is None else np.frombuffer(fresh, dtype=src.dtype)
        start = time.perf_counter()
        np.copyto(target, src)
        best = min(best, time.perf_counter() - start)
        del target
        if fresh is not None:
            fresh.close()
    return best


class Traffic:
    """``streams`` requests decoding at all times (each replaced as it finishes), in a thread of its own."""

    def __init__(self, url: str, streams: int, vocab: int) -> None:
        self.url, self.streams, self.vocab = url, streams, vocab
        self.stop = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(120)

    async def _main(self) -> None:
        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
            await asyncio.gather(*(self._stream(client, i) for i in range(self.streams)))

    async def _stream(self, client: Any, i: int) -> None:
        prompt = [(i * 7919 + j * 104729) % (self.vocab - 1) + 1 for j in range(64)]
        sampling = {"max_new_tokens": 160 + 24 * i, "temperature": 1.0, "ignore_eos": True}  # never all done at once
        while not self.stop.is_set():
            reply = await client.post("/generate", json={"input_ids": prompt, "sampling_params": sampling})
            if reply.status_code != 200:
                self.errors.append(reply.text)


def engine_counter(url: str, name: str) -> float:
    """The engine's counter ``rollwave_engine_<name>_total``."""
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"rollwave_engine_{name}_total "):
            return float(line.split()[1])
    raise RuntimeError(f"the engine exports no rollwave_engine_{name}_total")


def engine_totals(url: str, name: str) -> tuple[float, float]:
    """(count, sum) of the engine's histogram ``rollwave_engine_<name>_seconds``."""
    import httpx

    from services.report import histogram_totals

    return histogram_totals(httpx.get(url + "/metrics", timeout=30).text, f"rollwave_engine_{name}_seconds")


def run(pushes: int, layers: int, engine_threads: int, lora_rank: int, streams: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from core.config import CheckpointConfig, LoraConfig
    from rollout_server.engine.process import EngineProcess
    from trainer.checkpoint_pusher import CheckpointPusher, model_metas
    from trainer.lora import adapter_metas, add_adapter
    from trainer.parallel import iter_full_params

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="rollwave-bench-"))
    stage_dir = Path("/dev/shm") / work.name
    procs: list[subprocess.Popen] = []
    engine = None
    try:
        model_dir, n_params = build_model_dir(work / "model", layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        lora = add_adapter(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(rank=lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])).eval()
        lora_bytes = sum(m.nbytes for m in adapter_metas(lora))
        metas = model_metas(model)
        nbytes = sum(m.nbytes for m in metas)
        print(f"model: {n_params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB fp32, {len(metas)} tensors")
        engine = EngineProcess(model_dir, threads=engine_threads, log_path=work / "engine.log").start(timeout_s=300)
        receivers = {mode: child(["--serve-receiver", str(model_dir), engine.url, str(stage_dir / mode), mode], env)
                     for mode in SWAP_MODES}
        address = receivers["default"][1]
        sink, port = child(["--tcp-sink", str(nbytes), str(pushes)], env)
        counter, counter_port = child(["--grpc-sink"], env)
        procs += [proc for proc, _ in receivers.values()] + [sink, counter]

        src = np.concatenate([p.detach().reshape(-1).numpy().view(np.uint8) for p in model.parameters()])
        warm, fresh = memcpy_seconds(src, warm=True), memcpy_seconds(src, warm=False)

        pusher = CheckpointPusher(CheckpointConfig(token=TOKEN, stage_dir=stage_dir), [address])
        tcp, bare, stage, stage_grpc, pause, load, lora_pause = [], [], [], [], [], [], []
        in_call = CheckpointPusher(CheckpointConfig(token=TOKEN, stage_dir=stage_dir, stage_transport="grpc"),
                                   [address])
        version = 0

        def push(target: torch.nn.Module, via: CheckpointPusher | None = None) -> Any:
            nonlocal version
            version += 1
            with torch.no_grad():
                for p in target.parameters():
                    if p.requires_grad:  # the adapter alone of the LoRA model
                        p.add_(1e-3)
            rnd = pusher.push_model(target, version) if target is lora else \
                (via or pusher).push(metas, iter_full_params(model), version=version)
            [server] = rnd.wait(600).servers
            if not server.ok:
                raise RuntimeError(f"push of version {version} failed: {server.error}")
            return server

        push(model)  # the first stage of a run allocates its tmpfs pages; later ones reuse the served file's
        for round_ in range(pushes):
            tcp.append(raw_tcp_seconds(int(port), src))
            bare.append(raw_grpc_seconds(f"127.0.0.1:{counter_port}", src))
            for via in (None, in_call) if round_ % 2 == 0 else (in_call, None):
                (stage if via is None else stage_grpc).append(push(model, via).stage_seconds)
        in_call.close()
        for round_ in range(pushes):
            for target in (model, lora) if round_ % 2 == 0 else (lora, model):
                server = push(target)
                if target is lora:
                    lora_pause.append(server.pause_seconds)
                    continue
                pause.append(server.pause_seconds)
                load.append(server.load_seconds)
        pusher.close()

        pushers = {mode: CheckpointPusher(CheckpointConfig(token=TOKEN, stage_dir=stage_dir), [receivers[mode][1]])
                   for mode in SWAP_MODES}
        stall: dict[str, list[float]] = {mode: [] for mode in SWAP_MODES}
        busy_pause: dict[str, list[float]] = {mode: [] for mode in SWAP_MODES}
        reuse: dict[str, list[tuple[float, float]]] = {mode: [] for mode in SWAP_MODES}  # (ahead, cached) tokens
        with Traffic(engine.url, streams, model.config.vocab_size) as traffic:
            time.sleep(2.0)  # every stream is decoding
            quiet = [0.0, 0.0]  # (count, sum) of decode steps in windows with no push
            for round_ in range(pushes):
                for mode in list(SWAP_MODES)[round_ % 3:] + list(SWAP_MODES)[: round_ % 3]:
                    count, total = engine_totals(engine.url, "generation_stall")
                    tokens = [engine_counter(engine.url, name) for name in ("ahead_tokens", "cached_tokens")]
                    server = push(model, pushers[mode])
                    deadline = time.monotonic() + 60
                    time.sleep(0.25)  # no scrape of the engine's metrics while its first steps after the swap run
                    while (totals := engine_totals(engine.url, "generation_stall"))[0] == count:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.1)  # until the first token after the swap
                    count2, total2 = totals
                    if count2 != count + 1:
                        raise RuntimeError(f"{mode}: {count2 - count:g} stalls observed for one swap")
                    stall[mode].append(total2 - total)
                    ahead, cached = (engine_counter(engine.url, name) - t
                                     for name, t in zip(("ahead_tokens", "cached_tokens"), tokens, strict=True))
                    reuse[mode].append((ahead, cached))
                    busy_pause[mode].append(server.pause_seconds)
                before = engine_totals(engine.url, "decode_step")
                time.sleep(1.0)
                after = engine_totals(engine.url, "decode_step")
                quiet = [quiet[0] + after[0] - before[0], quiet[1] + after[1] - before[1]]
            decode_step = quiet[1] / quiet[0]
        for each in pushers.values():
            each.close()
        if traffic.errors:
            raise RuntimeError(f"{len(traffic.errors)} requests failed during (d): {traffic.errors[0]}")
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(60)
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage_dir, ignore_errors=True)

    gb = nbytes / 1e9
    med = statistics.median
    stage_gbs, tcp_gbs = gb / med(stage), gb / med(tcp)
    tuned = all(os.environ.get(k) == v for k, v in MALLOC_ENV.items())
    print(f"malloc: {'tuned (MALLOC_ENV)' if tuned else 'stock glibc'}; engine torch threads: "
          f"{engine_threads or 'default'}")
    print(f"(a) commit pause median {med(pause) * 1e3:.1f} ms (load {med(load) * 1e3:.1f} ms: "
          f"{', '.join(f'{s * 1e3:.0f}' for s in load)}) over {pushes} "
          f"commits; np.copyto {nbytes / 2**20:.0f} MiB warm {warm * 1e3:.1f} ms ({gb / warm:.1f} GB/s), "
          f"fresh pages {fresh * 1e3:.1f} ms ({gb / fresh:.1f} GB/s)")
    print(f"    pause / memcpy into fresh pages: {med(pause) / fresh:.2f}x (goal <= 3x against warm)")
    print(f"(b) stage {stage_gbs:.2f} GB/s (median of {pushes}: {', '.join(f'{s:.2f}s' for s in stage)}), "
          f"raw loopback TCP {tcp_gbs:.2f} GB/s ({', '.join(f'{s:.2f}s' for s in tcp)})")
    print(f"    stage with the bytes in the gRPC call (stage_transport: grpc) {gb / med(stage_grpc):.2f} GB/s "
          f"({', '.join(f'{s:.2f}s' for s in stage_grpc)})")
    print(f"    bare gRPC stream of 1 MiB messages (no digests, no file) {gb / med(bare):.2f} GB/s, "
          f"{tcp_gbs / (gb / med(bare)):.1f}x slower than raw TCP on its own")
    print(f"(c) LoRA rank {lora_rank} adapter ({lora_bytes / 2**20:.1f} MiB fp32): commit pause median "
          f"{med(lora_pause) * 1e3:.1f} ms ({', '.join(f'{s * 1e3:.1f}' for s in lora_pause)} ms), full push "
          f"{med(pause) * 1e3:.1f} ms")
    for mode in SWAP_MODES:
        print(f"(d) {mode:9s} with {streams} requests decoding: generation stall median "
              f"{med(stall[mode]) * 1e3:.1f} ms ({', '.join(f'{s * 1e3:.0f}' for s in stall[mode])} ms), "
              f"commit pause {med(busy_pause[mode]) * 1e3:.1f} ms")
        print("    tokens whose KV was computed ahead of each swap / taken from the prefix cache by then: "
              + ", ".join(f"{a:.0f}/{c:.0f}" for a, c in reuse[mode]) + "; commit pauses "
              + ", ".join(f"{p * 1e3:.0f}" for p in busy_pause[mode]) + " ms")
    print(f"    a decode step of those requests (their time between tokens) took {decode_step * 1e3:.1f} ms on "
          f"average in a 1 s window after each round, no push running; the stall counts one")
    print(f"stage_grpc_vs_raw_tcp ratio {med(tcp) / med(stage_grpc):.3f}")
    print(f"stage_vs_raw_tcp ratio {stage_gbs / tcp_gbs:.3f}")
    print(f"pause_vs_memcpy ratio {med(pause) / warm:.3f}")
    print(f"lora_pause_vs_full_pause ratio {med(lora_pause) / med(pause):.3f}")
    print(f"stall_keep_vs_decode_step ratio {med(stall['keep']) / decode_step:.3f}")
    print(f"stall_keep_vs_memcpy ratio {med(stall['keep']) / warm:.3f}")
    print(f"stall_reprefill_vs_memcpy ratio {med(stall['reprefill']) / warm:.3f}")
    print("goals: stage_vs_raw_tcp >= 0.5, stall_vs_memcpy <= 3")
    print(f"stall_vs_memcpy ratio {med(stall['default']) / warm:.3f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-receiver":
        asyncio.run(serve_receiver(*sys.argv[2:6]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--tcp-sink":
        tcp_sink(int(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--grpc-sink":
        grpc_sink()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pushes", type=int, default=5, help="pushes (and TCP rounds) to take the median of")
    parser.add_argument("--layers", type=int, default=9, help="decoder layers (9: ~100M parameters)")
    parser.add_argument("--engine-threads", type=int, default=0, help="engine's torch threads (0: its default)")
    parser.add_argument("--plain-malloc", action="store_true", help="keep stock glibc malloc")
    parser.add_argument("--lora-rank", type=int, default=16, help="rank of the adapter pushed in (c)")
    parser.add_argument("--streams", type=int, default=4, help="requests decoding during the pushes of (d)")
    args = parser.parse_args()
    if not args.plain_malloc and any(os.environ.get(k) != v for k, v in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], {**os.environ, **MALLOC_ENV})
    run(args.pushes, args.layers, args.engine_threads, args.lora_rank, args.streams)


if __name__ == "__main__":
    main()
