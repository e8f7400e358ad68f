"""PNG plots of a serving benchmark's JSON result (matplotlib, Agg backend: no display needed).

- a request-rate sweep: TTFT / TPOT / ITL / E2E (median and p99) against the request rate;
- a concurrency sweep: output and total token throughput against max concurrency;
- a single run: KV-cache usage, queue depth and running requests over time (from /metrics);
- a soak: each service's RSS against the requests done (benchmarks.soak --rss-plot).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: never needs a display
import matplotlib.pyplot as plt  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def plot_results(result: dict, out_dir: Path) -> list[Path]:
    """Writes the plots that fit `result` (as `benchmarks.serve` returns it); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep = result.get("sweep")
    if sweep == "request_rate":
        return [plot_latency_vs_rate(result["runs"], out_dir / "latency_vs_request_rate.png")]
    if sweep == "max_concurrency":
        return [plot_throughput_vs_concurrency(result["runs"], out_dir / "throughput_vs_concurrency.png")]
    return [plot_server_timeline(result.get("timeline", []), out_dir / "kv_usage_over_time.png")]


def _rate(run: dict) -> float:
    rate = run["request_rate"]
    return float("inf") if rate == "inf" else float(rate)


def plot_latency_vs_rate(runs: list[dict], path: Path) -> Path:
    runs = sorted(runs, key=_rate)
    rates = [_rate(r) for r in runs]
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(4 * len(LATENCIES), 3.6))
    for ax, (key, label) in zip(axes, LATENCIES, strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(rates, [r[f"{stat}_{key}_s"] * 1000 for r in runs], style, label=stat)
        ax.set_title(label)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend()
    return _save(fig, path)


def plot_throughput_vs_concurrency(runs: list[dict], path: Path) -> Path:
    runs = sorted(runs, key=lambda r: r["max_concurrency"] or 0)
    concurrency = [r["max_concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(concurrency, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
    ax.plot(concurrency, [r["total_token_throughput"] for r in runs], "s--", label="total tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_server_timeline(timeline: list[dict], path: Path) -> Path:
    times = [s["t_s"] for s in timeline]
    fig, (kv_ax, queue_ax) = plt.subplots(2, 1, figsize=(6.5, 5), sharex=True)
    kv_ax.plot(times, [_pct(s["kv_usage"]) for s in timeline], "-", color="tab:blue")
    kv_ax.set_ylabel("KV cache usage (%)")
    kv_ax.set_ylim(0, 105)
    kv_ax.set_title("Server state during the run (/metrics)")
    queue_ax.plot(times, [_nan(s["running"]) for s in timeline], "-", label="running")
    queue_ax.plot(times, [_nan(s["waiting"]) for s in timeline], "--", label="waiting")
    queue_ax.set_xlabel("seconds since start")
    queue_ax.set_ylabel("requests")
    queue_ax.legend()
    for ax in (kv_ax, queue_ax):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_rss_samples(samples: list[dict], path: Path, names: dict[str, str] | None = None,
                     xlabel: str = "requests", title: str = "Resident memory during the soak") -> Path:
    """Resident memory of each process over a soak (benchmarks.soak's `rss_samples`: requests done
    and MiB by listening port); `names` labels the ports (default: the launcher's)."""
    names = names or {"8000": "gateway", "50052": "scheduler", "50061": "worker"}
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for port in sorted({key for s in samples for key in s} - {"requests"}):
        ax.plot([s["requests"] for s in samples], [_nan(s.get(port)) for s in samples], "-",
                label=names.get(port, f"port {port}"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("RSS (MiB)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # pyplot keeps every open figure alive otherwise (sweeps make many)
    return path


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value  # a missing sample leaves a gap in the line


def _pct(value: float | None) -> float:
    return _nan(value) * 100
