"""Text tables, result files and plots of the benchmarks."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first left-aligned, the rest right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


def format_number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def format_percent(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}%}"


def format_serve_result(result: dict) -> str:
    """The summary block of `bench serve`, laid out as vLLM's."""
    server = result["server"]
    rows = [
        ("Successful requests", str(result["completed"])),
        ("Failed requests", str(result["failed"])),
        ("Maximum request concurrency", str(result["max_concurrency"] or "unlimited")),
        ("Request rate (req/s)", str(result["request_rate"])),
        ("Benchmark duration (s)", format_number(result["duration_s"])),
        ("Total input tokens", f"{result['total_input_tokens']:,}"),
        ("Total generated tokens", f"{result['total_output_tokens']:,}"),
        ("Request throughput (req/s)", format_number(result["request_throughput"], 3)),
        ("Output token throughput (tok/s)", format_number(result["output_throughput"])),
        ("Total token throughput (tok/s)", format_number(result["total_token_throughput"])),
        (f"Output tok/s per rank ({result['num_ranks'] or '?'} ranks)",
         format_number(result["output_throughput_per_rank"])),
        ("Total tok/s per rank", format_number(result["total_token_throughput_per_rank"])),
    ]
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"---{title}---", ""))
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", format_number(result[f"{stat}_{name}_ms"])))
    rows += [
        ("---Server (/metrics)---", ""),
        ("Peak KV cache usage", f"{server['peak_kv_usage']:.1%}"),
        ("Peak running requests", str(server["peak_running"])),
        ("Mean running requests", format_number(server["mean_running"], 1)),
        ("Peak waiting requests", str(server["peak_waiting"])),
        ("Preemptions", str(server["preemptions"])),
    ]
    if server.get("saturated_output_throughput") is not None:  # the generation counter, in the seconds that waited
        rows.append((f"Output tok/s while requests waited ({server['saturated_seconds']:.0f} s)",
                     format_number(server["saturated_output_throughput"])))
    if server.get("prefill_step_share") is not None:
        rows.append(("Step time in steps with prompt tokens", format_percent(server["prefill_step_share"])))
    if server["scrape_failures"]:
        rows.append(("Failed scrapes", str(server["scrape_failures"])))
    rows += [("---Prefix cache (usage.prompt_tokens_details)---", ""),
             ("Cached prompt tokens", "n/a" if result["total_cached_tokens"] is None
              else f"{result['total_cached_tokens']:,}"),
             ("Cached share of prompt tokens", format_percent(result["cached_fraction"]))]
    if len(result["turns"]) > 1:
        for turn in result["turns"]:
            rows.append((f"Turn {turn['turn'] + 1} ({turn['completed']}): prompt/cached, TTFT p50/p90 ms",
                         f"{turn['mean_input_len']:,.0f}/{format_number(turn['mean_cached_tokens'], 0)}, "
                         f"{turn['median_ttft_ms']:,.0f}/{turn['p90_ttft_ms']:,.0f}"))
    lines = [" Serving Benchmark Result ".center(60, "=")]
    for key, value in rows:
        lines.append(key.strip("-").center(60, "-") if key.startswith("---") else f"{key:<48}{value:>12}")
    lines.append("=" * 60)
    for error in result["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def plot_dcp_sweep(result: dict, path: str | Path) -> Path:
    """Two panels over the offered concurrency: output tok/s per rank, and peak running requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, running) = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in result["configs"]:
        points = config["points"]
        x = [p["concurrency"] for p in points]
        line, = throughput.plot(x, [p["output_throughput_per_rank"] for p in points], marker="o",
                                label=config["label"])
        running.plot(x, [p["server"]["peak_running"] for p in points], marker="o", color=line.get_color(),
                     label=f"{config['label']}: peak")
        running.plot(x, [p["server"]["mean_running"] for p in points], marker="x", linestyle="--",
                     color=line.get_color(), label=f"{config['label']}: time average")
    top = max(p["concurrency"] for c in result["configs"] for p in c["points"])
    running.plot([1, top], [1, top], linestyle=":", color="grey", label="all offered requests running")
    concurrencies = sorted({p["concurrency"] for c in result["configs"] for p in c["points"]})
    for axis, title in ((throughput, "output tok/s per rank"), (running, "running requests (/metrics)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("client concurrency")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    running.set_yscale("log", base=2)
    running.set_yticks(concurrencies, [str(c) for c in concurrencies])
    title = f"{result['model']}: KV {result['kv_cache_memory']} per rank, {result['workload']}"
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)  # a trace's description runs long
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
