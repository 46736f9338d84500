"""What a finished run reports: the learning curve and the summary, from the trainer's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
from prometheus_client.parser import text_string_to_metric_families

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def histogram_totals(exposition: str, name: str) -> tuple[float, float]:
    """(count, sum) of the histogram ``name`` in a Prometheus text exposition; (0, 0) when it is absent."""
    for family in text_string_to_metric_families(exposition):
        if family.name == name:
            values = {sample.name: sample.value for sample in family.samples}
            return values[f"{name}_count"], values[f"{name}_sum"]
    return 0.0, 0.0


def learning_curve(records: list[dict[str, Any]], before: float, after: float, path: Path) -> Path:
    """Training reward per step (and its running mean), with held-out accuracy before and after RL."""
    steps = [r["step"] for r in records]
    reward = [r["reward_mean"] for r in records]
    window = 5
    smooth = [sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
              for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, alpha=0.35, label="train reward (batch mean)")
    ax.plot(steps, smooth, label=f"train reward ({window}-step mean)")
    if steps:
        ax.scatter([0, steps[-1]], [before, after], color="black", zorder=3, label="held-out accuracy (greedy)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"rollwave demo: held-out accuracy {before:.3f} -> {after:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summarize(
    records: list[dict[str, Any]],
    job: dict[str, Any],
    status: dict[str, Any],
    *,
    before: float,
    after: float,
    rl_seconds: float,
    total_seconds: float,
    run_dir: Path,
) -> dict[str, Any]:
    head, tail = records[:5], records[-5:]
    pauses = [p for r in records for p in r.get("push_pause_ms", [])]
    lags = [(int(lag), n) for r in records for lag, n in r.get("staleness_hist", {}).items()]
    n_lag = sum(n for _, n in lags)
    generated = sum(r.get("loss_tokens", 0) for r in records)
    return {
        "run_dir": str(run_dir),
        "steps": len(records),
        "reward_start": _r(_mean([r["reward_mean"] for r in head])),
        "reward_end": _r(_mean([r["reward_mean"] for r in tail])),
        "heldout_accuracy_before": _r(before),
        "heldout_accuracy_after": _r(after),
        "heldout_gain": _r(after - before),
        "trained_tokens_per_s": _r(generated / rl_seconds if rl_seconds else None, 1),
        "pause_ms_mean": _r(_mean(pauses), 2),
        "pause_ms_max": _r(max(pauses, default=None), 2) if pauses else None,
        "staleness_mean": _r(sum(lag * n for lag, n in lags) / n_lag if n_lag else None),
        "staleness_max": max((lag for lag, n in lags if n), default=0),
        "groups_trained": job["progress"]["trained"],
        "groups_dropped_stale": job["progress"]["stale_dropped"],
        "groups_dropped_degenerate": job["progress"]["degenerate_dropped"],
        "explained_variance_end": _r(_mean([r["explained_variance"] for r in tail if "explained_variance" in r])),
        "final_policy_version": status["version"],
        "rl_seconds": round(rl_seconds, 1),
        "total_seconds": round(total_seconds, 1),
    }
