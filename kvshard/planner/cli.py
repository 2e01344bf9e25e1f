"""`kvshard plan`: predict what each TP/DCP layout gives for a model on a cluster.

kvshard's main CLI calls `add_plan_parser(subparsers)`; `python -m kvshard.planner` calls
`main()`. Both end in `run_plan`, which turns every input mistake into one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from kvshard.planner.arch import Quantization
from kvshard.planner.disaggregation import (Comparison, Split, compare, decode_result, default_prefill_tp,
                                             parse_split)
from kvshard.planner.errors import PlanError
from kvshard.planner.layout import check_tp, divisors, split_layouts
from kvshard.planner.plan import ConfigResult, PlanInputs, evaluate
from kvshard.planner.prefill import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_EFFICIENCY
from kvshard.planner.presets import load_gpu, load_model, load_workload
from kvshard.planner.recommend import Recommendation, recommend
from kvshard.planner.report import Report, plot, render, to_json
from kvshard.planner.roofline import BACKEND_SCHEMES, DEFAULT_COLLECTIVE_LATENCY_US
from kvshard.planner.seed import compare_with_seed, seed_inputs

DESCRIPTION = ("Predict, for a model on a GPU cluster, what each TP/DCP layout gives (attention-TP A = tp/dcp, "
               "query heads split or projections replicated in a DCP group): weights and KV per GPU, KV capacity, "
               "maximum concurrency, prefill time, decode tok/s per GPU from a roofline, what limits it, and which "
               "dcp, layout and DCP communication backend to use; with --disaggregate, colocated against "
               "disaggregated prefill/decode on the same GPUs. Needs no GPU.")

# GpuSpec fields that can be set from the command line, with their help.
_GPU_FLAGS = {
    "hbm_gib": (float, "HBM capacity per GPU, GiB"),
    "hbm_tbps": (float, "HBM bandwidth per GPU, TB/s"),
    "bf16_tflops": (float, "dense BF16 tensor rate per GPU, TFLOPS"),
    "fp8_tflops": (float, "dense FP8 tensor rate per GPU, TFLOPS (custom default: the BF16 rate)"),
    "nvlink_gbps": (float, "NVLink bandwidth per GPU and direction, GB/s; 0 = no NVLink (PCIe)"),
    "network_gbps": (float, "scale-out network per GPU and direction, GB/s (custom default 50)"),
    "pcie_gbps": (float, "PCIe bandwidth per GPU and direction, GB/s (custom default 64)"),
    "gpus_per_node": (int, "GPUs per NVLink domain (custom default 8)"),
}


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset (kimi-k2, kimi-k2.6, deepseek-v3, deepseek-v2-lite, llama-3.1-70b, "
                             "qwen3-235b-a22b) or a Hugging Face config.json file or directory")
    parser.add_argument("--gpu", required=True, help="B200, H200, H100, or custom (with the GPU flags below)")
    parser.add_argument("--gpus", type=int, required=True, help="number of GPUs in the cluster")
    parser.add_argument("--tp", type=int, help="tensor parallel size (default: one node, at most --gpus)")
    parser.add_argument("--dcp", default="auto", help="decode context parallel size, or auto (default): "
                                                      "every valid size, and pick one")
    parser.add_argument("--workload", help="agentic (67,000 input / 400 output tokens, the seed's medians)")
    parser.add_argument("--context-len", type=int, help="input tokens per request (with --output-len)")
    parser.add_argument("--output-len", type=int, help="output tokens per request (with --context-len)")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "bf16", "fp16", "fp8"),
                        help="KV cache dtype (auto: bf16)")
    parser.add_argument("--weights-dtype", "--quantization", dest="weights_dtype", default="auto",
                        choices=("auto", "bf16", "fp8", "int4"),
                        help="weights of every linear layer (auto: as the checkpoint ships)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of HBM the engine may use (default 0.9)")
    parser.add_argument("--reserve-gib", type=float, default=8.0,
                        help="GiB per GPU kept for activations, CUDA graphs and buffers (default 8)")
    parser.add_argument("--kv-memory-gib", type=float,
                        help="KV cache memory per GPU in GiB, instead of deriving it from HBM and weights")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=1024,
                        help="most requests one replica runs at once (default 1024)")
    parser.add_argument("--collective-latency-us", type=float, default=DEFAULT_COLLECTIVE_LATENCY_US,
                        help=f"fixed cost of one collective, microseconds (default {DEFAULT_COLLECTIVE_LATENCY_US:g})")
    parser.add_argument("--dcp-comm-backend", default="auto", choices=tuple(BACKEND_SCHEMES),
                        help="how a DCP group merges attention: ag_rs (LSE all-gather + reduce-scatter, or one "
                             "fused all-gather when cheaper), a2a (one all-to-all, merged locally), or auto "
                             "(default): the cheaper at each batch size")
    parser.add_argument("--a2a-latency-us", type=float,
                        help="fixed cost of one all-to-all, microseconds (default: --collective-latency-us)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="tokens per step, the prefill chunk size (default "
                             f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, vLLM's for its server on 70+ GiB GPUs)")
    parser.add_argument("--prefill-efficiency", type=float, default=DEFAULT_PREFILL_EFFICIENCY,
                        help="share of the datasheet FLOPS that prefill kernels reach, in (0, 1] "
                             f"(default {DEFAULT_PREFILL_EFFICIENCY:g})")
    parser.add_argument("--disaggregate", metavar="P:D",
                        help="also compare colocated serving on all --gpus with P GPUs that only prefill and D "
                             "that only decode (P + D = --gpus; decode at --tp and the plan's layout)")
    parser.add_argument("--prefill-tp", type=int,
                        help="tensor parallel size of the prefill instances with --disaggregate (default: one "
                             "node, at most P)")
    gpu_figures = parser.add_argument_group("GPU figures", "override a preset's, or describe --gpu custom")
    for name, (kind, text) in _GPU_FLAGS.items():
        gpu_figures.add_argument("--" + name.replace("_", "-"), type=kind, help=text)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of tok/s per GPU against concurrency")
    parser.add_argument("--compare-seed", action="store_true",
                        help="print predicted vs published numbers of the seed experiment "
                             "(--model kimi-k2.6 --gpu B200 --gpus 8 --workload agentic)")


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plan", help="DCP capacity and throughput planner (no GPU needed)",
                                   description=DESCRIPTION)
    add_plan_arguments(parser)
    parser.set_defaults(func=run_plan)


def _positive(value: float | int | None, flag: str) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise PlanError(f"{flag} must be positive, got {value}")


def _parse_dcp(value: str) -> int | None:
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"--dcp {value!r}: use auto or a whole number that divides --tp") from None


def _default_tp(num_gpus: int, gpus_per_node: int) -> int:
    """The largest TP group that divides the cluster and stays on one node."""
    return max(t for t in range(1, min(num_gpus, gpus_per_node) + 1) if num_gpus % t == 0)


def build_inputs(args: argparse.Namespace) -> PlanInputs:
    for flag in ("gpus", "tp", "block_size", "max_num_seqs", "kv_memory_gib", "context_len", "output_len",
                 "max_num_batched_tokens", "prefill_tp"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    if not 0 < args.prefill_efficiency <= 1:
        raise PlanError(f"--prefill-efficiency must be in (0, 1], got {args.prefill_efficiency}")
    if args.prefill_tp is not None and args.disaggregate is None:
        raise PlanError("--prefill-tp sets the prefill side of --disaggregate P:D: give --disaggregate too")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if not all(value >= 0 and math.isfinite(value)  # nan passes any comparison but these
               for value in (args.reserve_gib, args.collective_latency_us, args.a2a_latency_us or 0)):
        raise PlanError("--reserve-gib, --collective-latency-us and --a2a-latency-us must be numbers of at least 0")
    if args.plot and Path(args.plot).suffix.lower() != ".png":
        raise PlanError(f"--plot {args.plot}: give a file name ending in .png")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise PlanError(f"--plot {args.plot}: the directory {Path(args.plot).resolve().parent} does not exist")

    arch = load_model(args.model)
    if args.weights_dtype != "auto":
        arch = dataclasses.replace(arch, quantization=Quantization(dtype=args.weights_dtype, scope="linear"))
    gpu = load_gpu(args.gpu, {name: getattr(args, name) for name in _GPU_FLAGS})
    usable_gib = gpu.hbm_gib * args.gpu_memory_utilization
    if args.kv_memory_gib is None and args.reserve_gib >= usable_gib:
        raise PlanError(f"--reserve-gib {args.reserve_gib:g} leaves nothing of the {usable_gib:.1f} GiB a {gpu.name} "
                        "gives the engine (HBM x --gpu-memory-utilization): lower it, or give --kv-memory-gib")
    workload = load_workload(args.workload, args.context_len, args.output_len)
    tp = args.tp or _default_tp(args.gpus, gpu.gpus_per_node)
    requested_dcp = _parse_dcp(args.dcp)
    check_tp(arch, args.gpus, tp)
    if requested_dcp is not None and (requested_dcp < 1 or tp % requested_dcp):
        raise PlanError(f"--dcp {requested_dcp} does not divide --tp {tp}: DCP reuses the TP ranks, "
                        f"use one of {', '.join(map(str, divisors(tp)))}")
    layouts, refused = split_layouts(arch, tp, divisors(tp) if requested_dcp is None else sorted({1, requested_dcp}))
    if requested_dcp is not None and all(layout.dcp != requested_dcp for layout in layouts):
        why = "; ".join(dict.fromkeys(reason for layout, reason in refused if layout.dcp == requested_dcp))
        raise PlanError(f"--dcp {requested_dcp} cannot run {arch.name} at tp={tp}: {why}; use --dcp auto to "
                        "see every layout that can")
    if not layouts:
        raise PlanError(f"no DCP size gives a valid attention layout for {arch.name} at tp={tp} "
                        f"({refused[0][1]}): use a tp whose divisors divide the {arch.num_heads} query heads")
    kv_dtype = "bf16" if args.kv_dtype == "auto" else args.kv_dtype
    return PlanInputs(
        arch=arch, gpu=gpu, num_gpus=args.gpus, tp=tp, layouts=tuple(layouts), refused=tuple(refused),
        requested_dcp=requested_dcp, workload=workload, kv_dtype=kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, reserve_gib=args.reserve_gib,
        kv_memory_gib=args.kv_memory_gib, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        collective_latency_us=args.collective_latency_us, dcp_comm_backend=args.dcp_comm_backend,
        a2a_latency_us=args.a2a_latency_us, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_efficiency=args.prefill_efficiency)


def build_split(args: argparse.Namespace, inputs: PlanInputs) -> Split | None:
    """--disaggregate P:D and --prefill-tp, checked against the cluster; None without them."""
    if args.disaggregate is None:
        return None
    prefill_gpus, decode_gpus = parse_split(args.disaggregate, inputs.num_gpus)
    prefill_tp = args.prefill_tp or default_prefill_tp(inputs.arch, prefill_gpus, inputs.gpu.gpus_per_node)
    return Split(prefill_gpus=prefill_gpus, decode_gpus=decode_gpus, prefill_tp=prefill_tp)


def build_comparison(inputs: PlanInputs, results: list[ConfigResult], rec: Recommendation,
                     split: Split) -> Comparison:
    return compare(inputs, decode_result(inputs, results, rec.dcp, rec.attention_layout), split)


def run_plan(args: argparse.Namespace) -> int:
    try:
        inputs = build_inputs(args)
        split = build_split(args, inputs)
        if args.compare_seed:
            inputs = seed_inputs(inputs)
        results, too_big = evaluate(inputs)
        recommendation = recommend(inputs, results)
        comparison = build_comparison(inputs, results, recommendation, split) if split else None
    except PlanError as error:
        return _fail(str(error))
    report = Report(inputs=inputs, results=results, refused=[*inputs.refused, *too_big],
                    recommendation=recommendation,
                    seed_rows=compare_with_seed(inputs, results) if args.compare_seed else None,
                    comparison=comparison)
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        render(report)
    if args.plot:
        try:
            plot(report, Path(args.plot))
        except OSError as error:
            return _fail(f"--plot {args.plot}: {error.strerror}")
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _fail(message: str) -> int:
    print(f"kvshard plan: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard.planner", description=DESCRIPTION)
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))
