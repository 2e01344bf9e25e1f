"""Colocated vs disaggregated prefill/decode on the same GPUs: rates, TTFT, ITL.

Both sides of the comparison serve the workload (every request: L input tokens, O
output tokens) on G GPUs. The decode layout is the same in both (tp, dcp, attention
layout of the plan), so the difference is only where prefill runs.

Colocated: G / tp replicas, each prefills and decodes. A replica time-shares: per
request it spends the prefill time t_pf (chunked prefill, prefill.py) and its share
of the decode steps, O x t_step / b at b running requests (b = the KV ceiling, the
plan's operating point). Prefill alone would sustain R_p = replicas / t_pf requests/s,
decode alone R_d = replicas x b / (O x t_step); time-shared, R = 1 / (1/R_p + 1/R_d),
and the side with the larger share of the time limits it.

Disaggregated (`--disaggregate P:D`): P GPUs at `--prefill-tp` (dcp 1) only prefill,
R_p = P / prefill_tp / t_pf; D GPUs at the plan's tp and layout only decode,
R_d = D / tp x b / (O x t_step). The slower side limits: R = min(R_p, R_d).

Per GPU output: R x O / G tok/s for both.

TTFT (no queueing: a lower bound):
- colocated: each of the prompt's chunks rides in a step with the running decode
  batch: t_pf + chunks x t_step;
- disaggregated: t_pf on the prefill side, then the whole prompt's KV moves to the
  decode side (kvshard transfers after prefill, docs/disaggregation.md), then one
  decode step computes the last prompt token and samples the first output token:
  t_pf + t_kv + t_step. t_kv = the larger of the bytes one decode rank receives
  (its share of the prompt's KV in its own layout) and one prefill rank sends (the
  total spread over its tp ranks), over the link between the two sides (NVLink
  when both fit in one node, else the network: GpuSpec.link_gbps), plus one
  collective latency.

Inter-token latency:
- disaggregated: every decode step is t_step: p50 = p99 = t_step;
- colocated: a replica runs chunks x R_rep prefill chunks and R_rep x O / b decode
  steps per second; a chunk rides in a decode step, so a share
  f = min(1, chunks x b / O) of the decode steps also carries a chunk. p50 is
  t_step + the mean chunk when f >= 1/2, else t_step; p99 is t_step + the longest
  chunk (the last, which attends to the whole prompt: an upper estimate) when
  f >= 1/100, else t_step.

Left out: queueing, KV held by requests still in prefill or in transfer (it does not
count against b), overlap of the transfer with prefill, overlap of a colocated chunk's
compute-bound linear layers with the decode batch's weight reads (the mixed step pays
both in full), and prefix caching.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshard.planner.arch import ModelArch
from kvshard.planner.errors import PlanError
from kvshard.planner.layout import HEAD_SPLIT, AttentionLayout, check_tp, refusal
from kvshard.planner.memory import plan_memory, weight_bytes
from kvshard.planner.plan import ConfigResult, PlanInputs, prefill_for
from kvshard.planner.prefill import PrefillTime

P50_SHARE, P99_SHARE = 0.5, 0.01  # a step kind at least this common sets the percentile


@dataclass(frozen=True)
class Split:
    prefill_gpus: int
    decode_gpus: int
    prefill_tp: int

    @property
    def total(self) -> int:
        return self.prefill_gpus + self.decode_gpus


def parse_split(value: str, num_gpus: int) -> tuple[int, int]:
    """`--disaggregate P:D` -> (P, D); P + D must be the cluster, both at least 1."""
    parts = value.split(":")
    try:
        prefill, decode = (int(x) for x in parts) if len(parts) == 2 else (0, 0)
    except ValueError:
        prefill, decode = 0, 0
    if prefill < 1 or decode < 1:
        raise PlanError(f"--disaggregate {value!r}: give PREFILL_GPUS:DECODE_GPUS, two whole numbers of at "
                        f"least 1 that add up to --gpus {num_gpus}, e.g. {num_gpus // 2}:{num_gpus - num_gpus // 2}")
    if prefill + decode != num_gpus:
        raise PlanError(f"--disaggregate {value}: {prefill} + {decode} = {prefill + decode} GPUs, but --gpus is "
                        f"{num_gpus}: the two sides must add up to the cluster")
    return prefill, decode


@dataclass(frozen=True)
class ServingPrediction:
    """One way of serving the workload on the cluster."""

    mode: str  # "colocated" or "disaggregated"
    gpus: int
    prefill_gpus: int  # colocated: all of them, time-shared with decode
    decode_gpus: int
    prefill_layout: AttentionLayout
    decode_layout: AttentionLayout
    prefill: PrefillTime  # one request on one prefill replica
    prefill_rps: float  # requests/s the prefill capacity alone would sustain
    decode_concurrency: int  # requests decoding at once, whole cluster
    decode_step_s: float
    decode_rps: float  # requests/s the decode capacity alone would sustain
    output_len: int
    kv_transfer_bytes: float  # the prompt's KV, decode layout, all ranks together
    kv_transfer_s: float
    ttft_s: float
    itl_p50_s: float
    itl_p99_s: float
    chunk_step_share: float  # share of decode steps that carry a prefill chunk

    @property
    def rps(self) -> float:
        if self.mode == "colocated":
            return 1 / (1 / self.prefill_rps + 1 / self.decode_rps)
        return min(self.prefill_rps, self.decode_rps)

    @property
    def limit(self) -> str:
        return "prefill" if self.prefill_rps < self.decode_rps else "decode"

    @property
    def output_tok_s_per_gpu(self) -> float:
        return self.rps * self.output_len / self.gpus


def _decode_rps(result: ConfigResult, replicas: int, output_len: int) -> float:
    step = result.operating
    return replicas * step.batch / (output_len * step.step_s)


def colocated(inputs: PlanInputs, result: ConfigResult) -> ServingPrediction:
    step, prefill, out = result.operating, result.prefill, inputs.workload.output_len
    share = min(1.0, prefill.num_chunks * step.batch / out)
    return ServingPrediction(
        mode="colocated", gpus=inputs.num_gpus, prefill_gpus=inputs.num_gpus, decode_gpus=inputs.num_gpus,
        prefill_layout=result.layout, decode_layout=result.layout, prefill=prefill,
        prefill_rps=result.replicas / prefill.total_s, decode_concurrency=result.max_concurrency,
        decode_step_s=step.step_s, decode_rps=_decode_rps(result, result.replicas, out), output_len=out,
        kv_transfer_bytes=0.0, kv_transfer_s=0.0,
        ttft_s=prefill.total_s + prefill.num_chunks * step.step_s,
        itl_p50_s=step.step_s + (prefill.mean_chunk_s if share >= P50_SHARE else 0.0),
        itl_p99_s=step.step_s + (prefill.longest_chunk_s if share >= P99_SHARE else 0.0),
        chunk_step_share=share)


def default_prefill_tp(arch: ModelArch, prefill_gpus: int, gpus_per_node: int) -> int:
    """The largest tp that divides the prefill GPUs, stays in one node and can run the
    model (MLP widths and heads); a single GPU when none can."""
    def runs(tp: int) -> bool:
        try:
            check_tp(arch, prefill_gpus, tp)
        except PlanError:
            return False
        return refusal(arch, AttentionLayout(tp, 1, HEAD_SPLIT)) is None

    return max((t for t in range(1, min(prefill_gpus, gpus_per_node) + 1) if runs(t)), default=1)


def _prefill_side(inputs: PlanInputs, split: Split) -> tuple[AttentionLayout, PrefillTime]:
    """The prefill instances' layout (tp = --prefill-tp, no DCP) and prefill time."""
    arch, tp = inputs.arch, split.prefill_tp
    try:
        check_tp(arch, split.prefill_gpus, tp)
    except PlanError as error:
        raise PlanError(f"prefill side of --disaggregate ({split.prefill_gpus} GPUs): "
                        f"{str(error).replace('--gpus', 'its GPU count').replace('--tp', '--prefill-tp')}") from None
    layout = AttentionLayout(tp, 1, HEAD_SPLIT)
    if (why := refusal(arch, layout)) is not None:
        raise PlanError(f"--prefill-tp {tp} cannot run {arch.name}: {why}")
    memory = plan_memory(arch, inputs.gpu, layout, kv_dtype_bytes=inputs.kv_dtype_bytes,
                         gpu_memory_utilization=inputs.gpu_memory_utilization, reserve_gib=inputs.reserve_gib,
                         kv_memory_gib=inputs.kv_memory_gib, block_size=inputs.block_size)
    if isinstance(memory, str):
        raise PlanError(f"prefill side of --disaggregate: {memory.replace('--tp', '--prefill-tp')}")
    if memory.kv_capacity_tokens < inputs.workload.input_len:
        raise PlanError(f"prefill side at tp={tp} holds {memory.kv_capacity_tokens:,} KV tokens, less than one "
                        f"prompt of {inputs.workload.input_len:,}: raise --prefill-tp or give it more GPUs")
    return layout, prefill_for(inputs, weight_bytes(arch), layout, memory.kv_slot_bytes)


def disaggregated(inputs: PlanInputs, result: ConfigResult, split: Split) -> ServingPrediction:
    if split.total != inputs.num_gpus:
        raise PlanError(f"--disaggregate: {split.prefill_gpus} + {split.decode_gpus} GPUs is not --gpus "
                        f"{inputs.num_gpus}")
    if split.decode_gpus % inputs.tp:
        raise PlanError(f"--disaggregate {split.prefill_gpus}:{split.decode_gpus}: tp={inputs.tp} does not divide "
                        f"the {split.decode_gpus} decode GPUs: give the decode side a multiple of --tp")
    prefill_layout, prefill = _prefill_side(inputs, split)
    step, out = result.operating, inputs.workload.output_len
    decode_replicas = split.decode_gpus // inputs.tp

    # Each decode rank receives its own share of the prompt's KV; the prefill ranks
    # send the whole of it between them.
    per_decode_rank = inputs.workload.input_len * result.memory.kv_slot_bytes / result.dcp
    total = per_decode_rank * inputs.tp
    per_prefill_rank = total / prefill_layout.tp
    link = inputs.gpu.link_gbps(split.total) * 1e9
    transfer_s = max(per_decode_rank, per_prefill_rank) / link + inputs.collective_latency_us * 1e-6

    return ServingPrediction(
        mode="disaggregated", gpus=inputs.num_gpus, prefill_gpus=split.prefill_gpus,
        decode_gpus=split.decode_gpus, prefill_layout=prefill_layout, decode_layout=result.layout,
        prefill=prefill, prefill_rps=split.prefill_gpus // prefill_layout.tp / prefill.total_s,
        decode_concurrency=min(result.ceiling_per_replica, result.max_num_seqs) * decode_replicas,
        decode_step_s=step.step_s, decode_rps=_decode_rps(result, decode_replicas, out), output_len=out,
        kv_transfer_bytes=total, kv_transfer_s=transfer_s,
        ttft_s=prefill.total_s + transfer_s + step.step_s,
        itl_p50_s=step.step_s, itl_p99_s=step.step_s, chunk_step_share=0.0)


def decode_result(inputs: PlanInputs, results: list[ConfigResult], dcp: int, kind: str) -> ConfigResult:
    """The evaluated layout both sides decode with: the recommended one, or the faster
    layout of --dcp when one was asked for."""
    if inputs.requested_dcp is not None:
        asked = [r for r in results if r.dcp == inputs.requested_dcp and r.operating is not None]
        if asked:
            return max(asked, key=lambda r: (r.tok_s_per_gpu, r.layout.kind == HEAD_SPLIT))
    chosen = next((r for r in results if r.dcp == dcp and (dcp == 1 or r.layout.kind == kind)), None)
    if chosen is None or chosen.operating is None:
        raise PlanError(f"not one request of {inputs.tokens_per_request:,} tokens fits in the KV memory of any "
                        "layout: nothing to compare with --disaggregate; raise --tp or shorten the requests")
    return chosen


@dataclass(frozen=True)
class Comparison:
    colocated: ServingPrediction
    disaggregated: ServingPrediction

    @property
    def throughput_ratio(self) -> float:
        """Disaggregated over colocated output tok/s per GPU."""
        return self.disaggregated.output_tok_s_per_gpu / self.colocated.output_tok_s_per_gpu

    @property
    def balanced_prefill_share(self) -> float:
        """Share of the GPUs that should prefill for neither side to wait on the other:
        each side's GPU-seconds per request, prefill's over the sum."""
        d = self.disaggregated
        prefill = d.prefill_gpus / d.prefill_rps
        decode = d.decode_gpus / d.decode_rps
        return prefill / (prefill + decode)


def compare(inputs: PlanInputs, result: ConfigResult, split: Split) -> Comparison:
    return Comparison(colocated=colocated(inputs, result), disaggregated=disaggregated(inputs, result, split))
