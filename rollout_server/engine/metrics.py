"""Prometheus metrics of the embedded engine, in a registry the engine owns (served at ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class EngineMetrics:
    """``rollwave_engine_*``: tokens, queue depths, pauses and the stalls they cause, weight updates, the version."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.generated_tokens = Counter("rollwave_engine_generated_tokens", "Output tokens sampled", registry=r)
        self.prompt_tokens = Counter("rollwave_engine_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.ahead_tokens = Counter(
            "rollwave_engine_ahead_tokens",
            "Tokens of running requests whose KV was computed ahead under prepared weights (kv_on_swap: recompute)",
            registry=r,
        )
        self.cached_tokens = Counter(
            "rollwave_engine_cached_tokens", "Prompt tokens whose keys and values came from the prefix cache",
            registry=r,
        )
        self.shared_tokens = Counter(
            "rollwave_engine_shared_tokens",
            "Tokens not computed again because sequences prefilled together shared them (computed once): copies of a "
            "prompt, prefixes that prompts share, and running requests' shared prefixes computed ahead of a swap",
            registry=r,
        )
        self.requests = Counter(
            "rollwave_engine_requests", "Finished requests by finish reason (stop, length, abort; error: a step "
            "under it raised; nan: its logits were not finite)", ["finish"], registry=r,
        )
        self.running = Gauge("rollwave_engine_running_requests", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("rollwave_engine_waiting_requests", "Requests queued (including retracted)", registry=r)
        self.pending_updates = Gauge(
            "rollwave_engine_pending_weight_updates",
            "Weight loads waiting for the requests in flight to finish",
            registry=r,
        )
        self.paused_seconds = Counter(
            "rollwave_engine_paused_seconds", "Time spent paused (added at continue)", registry=r
        )
        self.generation_stall_seconds = Histogram(
            "rollwave_engine_generation_stall_seconds",
            "Per pause that stopped running requests: from the last token sampled before it to the first after it "
            "(the load and any re-prefill included)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.decode_step_seconds = Histogram(
            "rollwave_engine_decode_step_seconds",
            "One decode step of the running batch: a request's time between two tokens when no prefill or pause "
            "comes between",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.weight_update_seconds = Histogram(
            "rollwave_engine_weight_update_seconds",
            "Duration of a weight load",
            # a load of weights prepared while generating swaps pointers: milliseconds (bench/RESULTS.md)
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 30, 120),
            registry=r,
        )
        self.memory_bytes = Gauge(
            "rollwave_engine_memory_bytes", "Bytes held by the weights and by the KV cache", ["kind"], registry=r
        )
        self.http_refused = Counter(
            "rollwave_engine_http_refused", "HTTP requests answered 4xx (bad request, unauthorized, refused call), "
            "by status", ["status"], registry=r,
        )
        self.refused = Counter(
            "rollwave_engine_refused", "Control calls refused (engine busy, memory released), by call", ["call"],
            registry=r,
        )
        self.step_failures = Counter(
            "rollwave_engine_step_failures", "Engine steps (an admission or decode forward) that raised: the requests "
            "in them fail with the error, the engine goes on", registry=r,
        )
        self.version = Gauge(
            "rollwave_engine_weight_version_info", "1 for the weight version being served", ["version"], registry=r
        )

    def set_version(self, version: str) -> None:
        self.version.clear()
        self.version.labels(version=version).set(1)
