"""Show a plan: a terminal table, a JSON document, a PNG plot."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvshard.planner.disaggregation import Comparison, ServingPrediction
from kvshard.planner.hardware import GIB
from kvshard.planner.layout import AttentionLayout
from kvshard.planner.plan import ConfigResult, PlanInputs
from kvshard.planner.prefill import PrefillTime
from kvshard.planner.recommend import Recommendation
from kvshard.planner.roofline import StepTime
from kvshard.planner.seed import SeedRow


@dataclass(frozen=True)
class Report:
    inputs: PlanInputs
    results: list[ConfigResult]
    recommendation: Recommendation
    refused: list[tuple[AttentionLayout, str]] = field(default_factory=list)
    seed_rows: list[SeedRow] | None = None
    comparison: Comparison | None = None

    @property
    def tp_only(self) -> ConfigResult | None:
        return next((r for r in self.results if r.dcp == 1), None)

    def gain(self, result: ConfigResult) -> float | None:
        """tok/s per GPU against dcp=1; None when dcp=1 cannot run or fits no request."""
        base = self.tp_only.tok_s_per_gpu if self.tp_only else 0
        return result.tok_s_per_gpu / base if base else None


def _layout(result: ConfigResult) -> str:
    return result.layout.label


def _summary_lines(report: Report) -> list[str]:
    inputs = report.inputs
    arch, gpu, work = inputs.arch, inputs.gpu, inputs.workload
    params = arch.param_counts()
    attention = (f"MLA (latent {arch.kv_lora_rank}+{arch.qk_rope_head_dim})" if arch.is_mla
                 else f"GQA ({arch.num_heads} query / {arch.num_kv_heads} KV heads of {arch.head_dim})")
    link = (f"NVLink {gpu.nvlink_gbps:g} GB/s" if gpu.has_nvlink else f"no NVLink, PCIe {gpu.pcie_gbps:g} GB/s")
    return [
        f"model     {arch.name}: {attention}, {arch.num_layers} layers, {params.total / 1e9:,.1f}B params "
        f"({arch.active_params_per_token() / 1e9:,.1f}B active), weights {arch.quantization.describe()}, "
        f"KV {inputs.kv_dtype}",
        f"cluster   {inputs.num_gpus} x {gpu.name} ({gpu.hbm_gib:g} GiB, {gpu.hbm_tbps:g} TB/s, {link} per "
        f"direction), tp={inputs.tp}, {inputs.replicas} replica(s)",
        f"workload  {work.name}: {work.input_len:,} input + {work.output_len:,} output tokens per request",
    ]


def render(report: Report, console: Console | None = None) -> None:
    console = console or Console(width=shutil.get_terminal_size((160, 24)).columns)
    for line in _summary_lines(report):
        console.print(line, highlight=False, soft_wrap=True)

    table = Table(title="DCP layouts (per GPU; concurrency for the whole cluster)", title_justify="left")
    for column in ("layout", "weights GiB", "KV GiB", "KV B/token", "KV capacity tokens", "max concurrency",
                   "KV use", "tok/s/GPU", "vs dcp=1", "limit"):
        table.add_column(column, justify="left" if column in ("layout", "limit") else "right")
    for r in report.results:
        chosen = report.recommendation.chose(r)
        gain = report.gain(r)
        table.add_row(
            _layout(r) + (" *" if chosen else ""), f"{r.memory.weight_bytes_per_gpu / GIB:.1f}",
            f"{r.memory.kv_memory_bytes_per_gpu / GIB:.2f}", f"{r.memory.kv_bytes_per_token_per_gpu:,.0f}",
            f"{r.memory.kv_capacity_tokens:,}", f"{r.max_concurrency:,}", f"{r.kv_use:.0%}",
            f"{r.tok_s_per_gpu:,.0f}", "-" if gain is None else f"{gain:.2f}x", r.limit,
            style="bold" if chosen else None)
    console.print(table)
    for layout, why in report.refused:
        console.print(f"  refused: {layout.label}: {why}", highlight=False, soft_wrap=True)

    steps = Table(title="decode step at max concurrency (ms); prefill of one request's input on one replica (s)",
                  title_justify="left")
    for column in ("layout", "running/replica", "linear", "attention", "TP comm", "DCP comm", "DCP merge", "step",
                   "prefill s"):
        steps.add_column(column, justify="left" if column in ("layout", "DCP merge") else "right")
    for r in report.results:
        if r.operating is None:
            continue
        s = r.operating
        merge = "-" if r.dcp == 1 else f"{s.dcp_scheme}, {s.dcp_collectives_per_layer}/layer"
        steps.add_row(_layout(r), f"{s.batch:,}", *(f"{t * 1e3:.2f}" for t in (
            s.linear_s, s.attention_s, s.tp_comm_s, s.dcp_comm_s)), merge, f"{s.step_s * 1e3:.2f}",
            f"{r.prefill.total_s:.2f}")
    console.print(steps)

    rec = report.recommendation
    head = (f"use --tp {report.inputs.tp} --dcp {rec.dcp} (attention-TP A={rec.attention_tp}, "
            f"{rec.attention_layout}) --dcp-comm-backend {rec.comm_backend}, interleave size {rec.interleave_size}"
            if rec.dcp > 1 else "no DCP (--dcp 1)")
    console.print(f"[bold]recommendation:[/bold] {head}")
    for reason in rec.reasons:
        console.print(f"  - {reason}", highlight=False, soft_wrap=True)
    for warning in rec.warnings:
        console.print(f"  [yellow]! {warning}[/yellow]", highlight=False, soft_wrap=True)

    if report.comparison:
        render_comparison(report, console)

    if report.seed_rows:
        seed = Table(title="seed experiment: predicted vs published (8x B200, Kimi K2.6, agentic)",
                     title_justify="left")
        for column in ("quantity", "predicted", "published"):
            seed.add_column(column, justify="left" if column == "quantity" else "right")
        for row in report.seed_rows:
            seed.add_row(row.quantity, row.predicted, row.published)
        console.print(seed)


def _comparison_rows(p: ServingPrediction) -> dict[str, str]:
    """The comparison table's rows for one way of serving, in display order."""
    prefill_side = (f"{p.prefill_layout.label}, time-shared" if p.mode == "colocated"
                    else f"{p.prefill_gpus} GPUs at {p.prefill_layout.label}")
    return {
        "GPUs (prefill + decode)": (f"{p.gpus} (both on all)" if p.mode == "colocated"
                                    else f"{p.prefill_gpus} + {p.decode_gpus}"),
        "prefill": prefill_side,
        "decode": f"{p.decode_gpus} GPUs at {p.decode_layout.label}",
        "prefill time per request, s": f"{p.prefill.total_s:.2f} ({p.prefill.num_chunks} chunks)",
        "prefill side alone, req/s": f"{p.prefill_rps:.2f}",
        "decode concurrency": f"{p.decode_concurrency:,}",
        "decode step, ms": f"{p.decode_step_s * 1e3:.2f}",
        "decode side alone, req/s": f"{p.decode_rps:.2f}",
        "end to end, req/s": f"{p.rps:.2f}",
        "limited by": p.limit,
        "KV transfer per request": (f"{p.kv_transfer_bytes / GIB:.2f} GiB in {p.kv_transfer_s * 1e3:.1f} ms"
                                    if p.mode == "disaggregated" else "-"),
        "TTFT (no queueing), s": f"{p.ttft_s:.2f}",
        "ITL p50 / p99, ms": f"{p.itl_p50_s * 1e3:.1f} / {p.itl_p99_s * 1e3:.1f}",
        "decode steps carrying a chunk": f"{p.chunk_step_share:.0%}",
        "output tok/s per GPU": f"{p.output_tok_s_per_gpu:,.1f}",
    }


def render_comparison(report: Report, console: Console) -> None:
    comparison, inputs = report.comparison, report.inputs
    table = Table(title=f"colocated vs disaggregated prefill/decode on {inputs.num_gpus} x {inputs.gpu.name} "
                        f"({inputs.workload.input_len:,} in / {inputs.workload.output_len:,} out per request)",
                  title_justify="left")
    for column in ("", "colocated", "disaggregated"):
        table.add_column(column, justify="right" if column else "left")
    rows = [_comparison_rows(comparison.colocated), _comparison_rows(comparison.disaggregated)]
    for name in rows[0]:
        table.add_row(name, rows[0][name], rows[1][name])
    console.print(table)
    colo, disagg = comparison.colocated, comparison.disaggregated
    console.print(f"disaggregated / colocated output tok/s per GPU: {comparison.throughput_ratio:.2f}x; TTFT "
                  f"{colo.ttft_s:.2f} -> {disagg.ttft_s:.2f} s; ITL p99 {colo.itl_p99_s * 1e3:.1f} -> "
                  f"{disagg.itl_p99_s * 1e3:.1f} ms (prefill at {inputs.prefill_efficiency:g} x peak FLOPS, "
                  f"chunks of {inputs.max_num_batched_tokens:,} tokens)", highlight=False, soft_wrap=True)
    share = comparison.balanced_prefill_share
    console.print(f"the two sides balance with {share:.0%} of the GPUs prefilling (about "
                  f"{share * inputs.num_gpus:.1f} of {inputs.num_gpus}, before rounding to whole instances)",
                  highlight=False, soft_wrap=True)


def _prediction_json(p: ServingPrediction) -> dict[str, Any]:
    return {"gpus": p.gpus, "prefill_gpus": p.prefill_gpus, "decode_gpus": p.decode_gpus,
            "prefill_tp": p.prefill_layout.tp, "prefill_dcp": p.prefill_layout.dcp,
            "decode_tp": p.decode_layout.tp, "decode_dcp": p.decode_layout.dcp,
            "decode_attention_layout": p.decode_layout.kind,
            "prefill_s": p.prefill.total_s, "prefill_chunks": p.prefill.num_chunks,
            "prefill_rps": p.prefill_rps, "decode_concurrency": p.decode_concurrency,
            "decode_step_ms": p.decode_step_s * 1e3, "decode_rps": p.decode_rps, "rps": p.rps,
            "limit": p.limit, "kv_transfer_bytes": p.kv_transfer_bytes, "kv_transfer_ms": p.kv_transfer_s * 1e3,
            "ttft_s": p.ttft_s, "itl_p50_ms": p.itl_p50_s * 1e3, "itl_p99_ms": p.itl_p99_s * 1e3,
            "chunk_step_share": p.chunk_step_share, "output_tok_s_per_gpu": p.output_tok_s_per_gpu}


def _prefill_json(prefill: PrefillTime) -> dict[str, Any]:
    return {"prefill_s": prefill.total_s, "chunks": prefill.num_chunks, "chunk_tokens": prefill.chunk_tokens,
            "linear_s": prefill.linear_s, "attention_s": prefill.attention_s, "tp_comm_s": prefill.tp_comm_s,
            "dcp_comm_s": prefill.dcp_comm_s, "longest_chunk_ms": prefill.longest_chunk_s * 1e3,
            "tokens_per_s_per_replica": prefill.tokens_per_s}


def _step_json(step: StepTime) -> dict[str, Any]:
    return {"batch": step.batch, "step_ms": step.step_s * 1e3, "linear_ms": step.linear_s * 1e3,
            "attention_ms": step.attention_s * 1e3, "tp_comm_ms": step.tp_comm_s * 1e3,
            "dcp_comm_ms": step.dcp_comm_s * 1e3, "dcp_merge": step.dcp_scheme,
            "dcp_collectives_per_layer": step.dcp_collectives_per_layer, "tok_s_per_gpu": step.tok_s_per_gpu,
            "bound": step.limit}


def to_json(report: Report) -> dict[str, Any]:
    inputs = report.inputs
    arch, params = inputs.arch, inputs.arch.param_counts()
    doc: dict[str, Any] = {
        "model": {"name": arch.name, "attention": arch.attention, "layers": arch.num_layers,
                  "params_total": params.total, "params_active_per_token": arch.active_params_per_token(),
                  "weights": arch.quantization.describe(), "kv_dtype": inputs.kv_dtype},
        "gpu": asdict(inputs.gpu),
        "cluster": {"num_gpus": inputs.num_gpus, "tp": inputs.tp, "replicas": inputs.replicas},
        "workload": asdict(inputs.workload),
        "assumptions": {"gpu_memory_utilization": inputs.gpu_memory_utilization,
                        "reserve_gib": inputs.reserve_gib, "kv_memory_gib": inputs.kv_memory_gib,
                        "block_size": inputs.block_size, "max_num_seqs": inputs.max_num_seqs,
                        "collective_latency_us": inputs.collective_latency_us,
                        "a2a_latency_us": inputs.a2a_latency_us, "dcp_comm_backend": inputs.dcp_comm_backend,
                        "mean_context_len": inputs.mean_context_len,
                        "max_num_batched_tokens": inputs.max_num_batched_tokens,
                        "prefill_efficiency": inputs.prefill_efficiency},
        "configs": [{
            "tp": r.tp, "dcp": r.dcp, "attention_tp": r.layout.attention_tp, "attention_layout": r.layout.kind,
            "weight_gib_per_gpu": r.memory.weight_bytes_per_gpu / GIB,
            "kv_memory_gib_per_gpu": r.memory.kv_memory_bytes_per_gpu / GIB,
            "kv_bytes_per_token_per_gpu": r.memory.kv_bytes_per_token_per_gpu,
            "kv_slot_bytes": r.memory.kv_slot_bytes,
            "kv_blocks_per_gpu": r.memory.kv_blocks_per_gpu,
            "kv_capacity_tokens": r.memory.kv_capacity_tokens,
            "max_concurrency": r.max_concurrency,
            "kv_use": r.kv_use,
            "tok_s_per_gpu": r.tok_s_per_gpu,
            "gain_vs_dcp1": report.gain(r),
            "limit": r.limit,
            "step": _step_json(r.operating) if r.operating else None,
            "prefill": _prefill_json(r.prefill),
            "curve": [{"concurrency": p.concurrency, "running_per_replica": p.running_per_replica,
                       "step_ms": p.step.step_s * 1e3, "tok_s_per_gpu": p.step.tok_s_per_gpu}
                      for p in r.curve],
        } for r in report.results],
        "refused": [{"tp": layout.tp, "dcp": layout.dcp, "attention_layout": layout.kind, "reason": why}
                    for layout, why in report.refused],
        "recommendation": asdict(report.recommendation),
    }
    if report.comparison:
        doc["disaggregation"] = {"colocated": _prediction_json(report.comparison.colocated),
                                 "disaggregated": _prediction_json(report.comparison.disaggregated),
                                 "throughput_ratio": report.comparison.throughput_ratio,
                                 "balanced_prefill_share": report.comparison.balanced_prefill_share}
    if report.seed_rows:
        doc["seed_comparison"] = [asdict(row) for row in report.seed_rows]
    return doc


def plot(report: Report, path: Path) -> None:
    """tok/s per GPU against cluster concurrency, one line per layout; the marker is
    where KV memory (or the scheduler cap) stops the growth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inputs = report.inputs
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in report.results:
        if not r.curve:
            continue
        line, = ax.plot([p.concurrency for p in r.curve], [p.step.tok_s_per_gpu for p in r.curve],
                        label=_layout(r), linewidth=2.5 if report.recommendation.chose(r) else 1.5)
        ax.plot([r.max_concurrency], [r.tok_s_per_gpu], "o", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (cluster)")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title(f"{inputs.arch.name} on {inputs.num_gpus}x {inputs.gpu.name}, {inputs.workload.name} "
                 f"(roofline prediction)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
