"""`kvshard plan`: the arithmetic, the roofline, the advice and the command line.

Numbers checked against published figures: KV bytes per token of MLA and GQA models,
vLLM's Kimi-K2 KV capacity at tp=8 with and without dcp=8, and the model cards'
parameter counts. The seed experiment's predictions are pinned so a change to the
model shows up here and in docs/planner.md together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvshard.planner.arch import Quantization
from kvshard.planner.cli import add_plan_parser, build_inputs, main, run_plan
from kvshard.planner.disaggregation import Split, compare
from kvshard.planner.layout import HEAD_SPLIT, REPLICATED, AttentionLayout, divisors, refusal, split_layouts
from kvshard.planner.memory import kv_slot_bytes, plan_memory, weight_bytes, weight_bytes_per_gpu
from kvshard.planner.plan import evaluate
from kvshard.planner.prefill import prefill_time
from kvshard.planner.presets import load_gpu, load_model, model_presets
from kvshard.planner.recommend import recommend
from kvshard.planner.roofline import A2A, AG_RS, AG_RS_FUSED, decode_step, dcp_merge_schemes, routed_expert_fraction

REPO = Path(__file__).resolve().parents[1]
SEED_ARGS = ["--model", "kimi-k2.6", "--gpu", "B200", "--gpus", "8", "--workload", "agentic"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    add_plan_parser(subparsers)
    return parser.parse_args(["plan", *argv])


def layout(tp: int, dcp: int = 1, kind: str = HEAD_SPLIT) -> AttentionLayout:
    return AttentionLayout(tp, dcp, kind)


def plan(argv: list[str]):
    """(inputs, {dcp: result of the head-split layout, or of the replicated one where
    head-split cannot run}, {(dcp, kind): result}, recommendation)."""
    inputs = build_inputs(parse(argv))
    results, _ = evaluate(inputs)
    by_layout = {(r.dcp, r.layout.kind): r for r in results}
    by_dcp = {r.dcp: by_layout.get((r.dcp, HEAD_SPLIT), r) for r in results}
    return inputs, by_dcp, by_layout, recommend(inputs, results)


def small_gqa_config(tmp_path: Path) -> str:
    """A SmolLM2-135M-shaped config: 9 query / 3 KV heads of 64, MLP 1,536."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 30,
              "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
              "vocab_size": 49152, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- KV arithmetic -----------------------------------------------------------------


@pytest.mark.parametrize("model", ["kimi-k2", "kimi-k2.6", "deepseek-v3"])
def test_mla_kv_bytes_per_token_is_61_layers_of_576_bf16_values(model: str) -> None:
    arch = load_model(model)
    assert kv_slot_bytes(arch, layout(8), kv_dtype_bytes=2) == 61 * 576 * 2 == 70_272
    # MLA replicates the latent on every TP rank: tp does not shrink it.
    assert kv_slot_bytes(arch, layout(1), kv_dtype_bytes=2) == 70_272


def test_mla_kv_per_gpu_divides_by_dcp() -> None:
    arch, gpu = load_model("kimi-k2"), load_gpu("B200", {})
    per_gpu = {dcp: plan_memory(arch, gpu, layout(8, dcp), kv_dtype_bytes=2, gpu_memory_utilization=0.9, reserve_gib=8,
                                kv_memory_gib=46.80, block_size=16).kv_bytes_per_token_per_gpu
               for dcp in (1, 2, 4, 8)}
    assert per_gpu == {1: 70_272, 2: 35_136, 4: 17_568, 8: 8_784}


def test_gqa_kv_bytes_per_token_llama_70b() -> None:
    arch = load_model("llama-3.1-70b")
    assert kv_slot_bytes(arch, layout(8), kv_dtype_bytes=2) == 80 * 2 * 1 * 128 * 2 == 40_960
    assert kv_slot_bytes(arch, layout(4), kv_dtype_bytes=2) == 80 * 2 * 2 * 128 * 2
    # tp=16 > 8 KV heads: every rank still holds one whole head, each head twice.
    assert kv_slot_bytes(arch, layout(16), kv_dtype_bytes=2) == 40_960
    assert kv_slot_bytes(arch, layout(8), kv_dtype_bytes=1) == 20_480


def _every_layout(arch_spec: str, tp: int) -> list[AttentionLayout]:
    valid, _ = split_layouts(load_model(arch_spec), tp, divisors(tp))
    return valid


@pytest.mark.parametrize("model, tp", [("llama-3.1-70b", 8), ("llama-3.1-70b", 16), ("qwen3-235b-a22b", 8),
                                       ("kimi-k2", 8), ("deepseek-v2-lite", 4)])
def test_kv_bytes_per_token_per_gpu_is_the_attention_tp_shard_over_dcp(model: str, tp: int) -> None:
    arch = load_model(model)
    for lay in _every_layout(model, tp):
        # GQA: max(1, kv_heads / A) heads of K and V; MLA: the latent; then / N.
        heads = 1 if arch.is_mla else max(1, arch.num_kv_heads // lay.attention_tp)
        values = arch.kv_lora_rank + arch.qk_rope_head_dim if arch.is_mla else 2 * arch.head_dim
        memory = plan_memory(arch, load_gpu("B200", {}), lay, kv_dtype_bytes=2, gpu_memory_utilization=0.9,
                             reserve_gib=8, kv_memory_gib=10, block_size=16)
        assert memory.kv_bytes_per_token_per_gpu == arch.num_layers * heads * values * 2 / lay.dcp, lay


def test_kv_bytes_of_9_query_3_kv_heads_at_tp_6_dcp_2(tmp_path: Path) -> None:
    arch = load_model(small_gqa_config(tmp_path))
    lay = layout(6, 2, REPLICATED)  # A = 3: one KV head per group, its tokens split over 2 ranks
    assert lay.attention_tp == 3 and lay.kv_heads_per_rank(arch) == 1
    memory = plan_memory(arch, load_gpu("H100", {}), lay, kv_dtype_bytes=2, gpu_memory_utilization=0.9,
                         reserve_gib=8, kv_memory_gib=10, block_size=16)
    assert memory.kv_bytes_per_token_per_gpu == 30 * 1 * 2 * 64 * 2 / 2 == 3_840


@pytest.mark.parametrize("model, tp", [("llama-3.1-70b", 16), ("kimi-k2.6", 8), ("qwen3-235b-a22b", 8)])
def test_fp8_kv_halves_bytes_per_token_and_doubles_capacity_in_every_layout(model: str, tp: int) -> None:
    arch, gpu = load_model(model), load_gpu("B200", {})
    for lay in _every_layout(model, tp):
        bf16, fp8 = (plan_memory(arch, gpu, lay, kv_dtype_bytes=b, gpu_memory_utilization=0.9, reserve_gib=8,
                                 kv_memory_gib=None, block_size=16) for b in (2, 1))
        assert fp8.kv_bytes_per_token_per_gpu * 2 == bf16.kv_bytes_per_token_per_gpu, lay
        # Whole blocks: twice the blocks, or one more where the bf16 count rounded down.
        assert 0 <= fp8.kv_capacity_tokens - 2 * bf16.kv_capacity_tokens < 16 * lay.dcp * 2, lay
        assert fp8.weight_bytes_per_gpu == bf16.weight_bytes_per_gpu


def test_kv_dtype_flag_reaches_every_layout() -> None:
    argv = ["--model", "llama-3.1-70b", "--gpu", "H100", "--gpus", "16", "--tp", "16", "--workload", "agentic"]
    _, _, bf16, _ = plan(argv)
    _, _, fp8, _ = plan([*argv, "--kv-dtype", "fp8"])
    assert set(fp8) == set(bf16)
    for key, result in fp8.items():
        assert result.memory.kv_bytes_per_token_per_gpu * 2 == bf16[key].memory.kv_bytes_per_token_per_gpu


def test_replicated_projections_cost_n_times_the_query_side_weights() -> None:
    # Llama-3.1-70B at tp=16: every rank of a group of N holds 1/A of q_proj instead of
    # 1/16; K/V stay one whole head per rank until A drops below the 8 KV heads.
    arch = load_model("llama-3.1-70b")
    weights, q_bytes, kv_bytes = weight_bytes(arch), 80 * 8192 * 8192 * 2, 80 * 2 * 8192 * 1024 * 2
    head_split = weight_bytes_per_gpu(arch, weights, layout(16, 2, HEAD_SPLIT))
    assert head_split == pytest.approx(weights.total / 16 + kv_bytes / 8 - kv_bytes / 16)
    for dcp in (2, 4, 8, 16):
        a = 16 // dcp
        replicated = weight_bytes_per_gpu(arch, weights, layout(16, dcp, REPLICATED))
        expected = (weights.total / 16 + q_bytes * (1 / a - 1 / 16)
                    + kv_bytes * (max(8 / a, 1) / 8 - 1 / 16))
        assert replicated == pytest.approx(expected), dcp
    # MLA: q_b_proj, W_UK and W_UV, N times (Kimi K2.6 keeps attention in bf16).
    k26 = load_model("kimi-k2.6")
    per_layer = 1536 * 64 * 192 + 512 * 64 * 128 + 512 * 64 * 128
    extra = (weight_bytes_per_gpu(k26, weight_bytes(k26), layout(8, 8, REPLICATED))
             - weight_bytes_per_gpu(k26, weight_bytes(k26), layout(8, 8, HEAD_SPLIT)))
    assert extra == pytest.approx(61 * per_layer * 2 * (1 - 1 / 8))


@pytest.mark.parametrize("dcp, published", [(1, 715_072), (8, 5_721_088)])
def test_kimi_k2_capacity_matches_vllm_published(dcp: int, published: int) -> None:
    memory = plan_memory(load_model("kimi-k2"), load_gpu("B200", {}), layout(8, dcp), kv_dtype_bytes=2,
                         gpu_memory_utilization=0.9, reserve_gib=8, kv_memory_gib=46.80, block_size=16)
    assert memory.kv_capacity_tokens == pytest.approx(published, rel=0.01)


@pytest.mark.parametrize("model, tp", [("kimi-k2.6", 8), ("deepseek-v2-lite", 4), ("qwen3-235b-a22b", 8),
                                       ("llama-3.1-70b", 16)])
def test_head_split_dcp_multiplies_capacity_without_touching_weights(model: str, tp: int) -> None:
    arch, gpu = load_model(model), load_gpu("B200", {})
    valid, _ = split_layouts(arch, tp, divisors(tp))
    memory = {lay.dcp: plan_memory(arch, gpu, lay, kv_dtype_bytes=2, gpu_memory_utilization=0.9, reserve_gib=8,
                                   kv_memory_gib=None, block_size=16) for lay in valid if lay.kind == HEAD_SPLIT}
    assert len(memory) > 1
    for dcp, m in memory.items():
        assert m.kv_capacity_tokens == dcp * memory[1].kv_capacity_tokens
        assert m.weight_bytes_per_gpu == memory[1].weight_bytes_per_gpu


def _valid(model: str, tp: int, kind: str) -> list[int]:
    valid, _ = split_layouts(load_model(model), tp, divisors(tp))
    return [lay.dcp for lay in valid if lay.kind == kind]


def test_head_split_layouts_follow_todays_rules() -> None:
    assert _valid("kimi-k2", 8, HEAD_SPLIT) == [1, 2, 4, 8]  # MLA: any divisor of tp
    assert _valid("llama-3.1-70b", 8, HEAD_SPLIT) == [1]  # tp == kv heads: no replicas
    assert _valid("llama-3.1-70b", 16, HEAD_SPLIT) == [1, 2]  # 2 replicas per head
    assert _valid("qwen3-235b-a22b", 8, HEAD_SPLIT) == [1, 2]  # 4 KV heads


def test_replicated_projections_allow_any_dcp_whose_attention_tp_divides_the_heads() -> None:
    # A = tp / dcp only has to divide the query heads and divide (or be a multiple of)
    # the KV heads: Llama-3.1-70B on 16 GPUs runs dcp=16 with A=1.
    assert _valid("llama-3.1-70b", 16, REPLICATED) == [2, 4, 8, 16]
    assert _valid("llama-3.1-70b", 8, REPLICATED) == [2, 4, 8]
    assert _valid("kimi-k2", 8, REPLICATED) == [2, 4, 8]


def test_layouts_are_refused_with_the_rule_they_break(tmp_path: Path) -> None:
    small, llama = load_model(small_gqa_config(tmp_path)), load_model("llama-3.1-70b")
    assert refusal(small, layout(6, 1)) == "attention-TP A = 6/1 = 6 does not divide the 9 query heads"
    assert refusal(small, layout(6, 2, HEAD_SPLIT)) == "head-split needs tp=6 to divide the 9 query heads"
    assert refusal(small, layout(6, 2, REPLICATED)) is None
    assert refusal(llama, layout(16, 4, HEAD_SPLIT)).startswith("head-split needs dcp <= tp/kv_heads = 16/8")
    assert refusal(llama, layout(16, 4, REPLICATED)) is None
    # 12 KV heads, A = 8: neither divides the other.
    twelve = dataclasses.replace(llama, num_heads=96, num_kv_heads=12)
    assert refusal(twelve, layout(16, 2, REPLICATED)) == (
        "attention-TP A = 16/2 = 8 neither divides nor is a multiple of the 12 KV heads")


# --- model configs and weights --------------------------------------------------------


@pytest.mark.parametrize("model", sorted(model_presets()))
def test_preset_parameter_counts_match_the_model_cards(model: str) -> None:
    arch = load_model(model)
    assert arch.param_counts().total / 1e9 == pytest.approx(arch.published_total_params_b, rel=0.03)
    assert arch.active_params_per_token() / 1e9 == pytest.approx(arch.published_active_params_b, rel=0.05)


def test_checkpoint_quantization_is_read_from_the_config() -> None:
    assert load_model("kimi-k2.6").quantization == Quantization(dtype="int4", scope="routed_experts", group_size=32)
    assert load_model("deepseek-v3").quantization.dtype == "fp8"
    assert load_model("llama-3.1-70b").quantization.dtype == "bf16"
    # INT4 with a bf16 scale per 32 weights: 0.5625 bytes; the rest of K2.6 stays bf16.
    k26, k2 = weight_bytes(load_model("kimi-k2.6")), weight_bytes(load_model("kimi-k2"))
    assert k26.routed_experts == pytest.approx(k2.routed_experts / (1 + 4 / 128**2) * 0.5625)
    assert k26.total / 1e9 == pytest.approx(594, rel=0.01)


def test_hf_config_file_or_directory_gives_the_preset_architecture(tmp_path: Path) -> None:
    config = json.loads((REPO / "kvshard/planner/presets/llama-3.1-70b.json").read_text())
    del config["planner"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    preset = load_model("llama-3.1-70b")
    for spec in (tmp_path, tmp_path / "config.json"):
        arch = load_model(str(spec))
        assert arch.param_counts() == preset.param_counts()
        assert kv_slot_bytes(arch, layout(8), 2) == 40_960


def test_presets_resolve_by_hugging_face_repo_id() -> None:
    assert load_model("moonshotai/Kimi-K2.6").name == "Kimi-K2.6"
    assert load_model("Qwen3-235B-A22B").name == "Qwen3-235B-A22B"


# --- roofline -------------------------------------------------------------------------


def test_routed_expert_fraction() -> None:
    arch = load_model("kimi-k2")
    assert routed_expert_fraction(arch, 1) == pytest.approx(8 / 384)
    assert routed_expert_fraction(arch, 1024) == pytest.approx(1.0, abs=1e-6)
    assert routed_expert_fraction(load_model("llama-3.1-70b"), 64) == 0.0


def _step(model: str, dcp: int, batch: int, context: float, latency_us: float = 10.0, backend: str = "ag_rs",
          kind: str = HEAD_SPLIT):
    arch, gpu = load_model(model), load_gpu("B200", {})
    lay = layout(8, dcp, kind)
    return decode_step(arch, gpu, weight_bytes(arch), lay, kv_slot_bytes=kv_slot_bytes(arch, lay, 2),
                       batch=batch, context_len=context, collective_latency_us=latency_us, backend=backend)


def test_dcp_divides_the_kv_read_of_a_memory_bound_attention() -> None:
    tp_only, dcp8 = _step("kimi-k2.6", 1, 64, 67_200), _step("kimi-k2.6", 8, 64, 67_200)
    assert not tp_only.attention_compute_bound and not dcp8.attention_compute_bound
    assert tp_only.attention_s == pytest.approx(64 * 67_200 * 70_272 / 8e12)
    assert dcp8.attention_s == pytest.approx(tp_only.attention_s / 8)
    assert dcp8.linear_s == tp_only.linear_s  # same weights, same batch


def test_dcp_collective_volume_follows_design_section_4() -> None:
    # Per layer, rank and token: Q gather (N-1)*H_l*576 bf16, LSE gather (N-1)*N*H_l
    # fp32, reduce-scatter (N-1)*H_l*512 bf16; Kimi K2 at tp=8: H_l = 8, N = 8.
    per_token_layer = 7 * 8 * 576 * 2 + 7 * 8 * 8 * 4 + 7 * 8 * 512 * 2
    step = _step("kimi-k2", 8, 1, 67_200, latency_us=0)
    assert (step.dcp_scheme, step.dcp_collectives_per_layer) == (AG_RS, 3)
    assert step.dcp_comm_s == pytest.approx(61 * per_token_layer / 900e9)
    assert _step("kimi-k2", 8, 1024, 67_200).dcp_comm_s == pytest.approx(
        1024 * step.dcp_comm_s + 61 * 3 * 10e-6)
    # It grows with the batch, never with the context length.
    assert _step("kimi-k2", 8, 1, 1_000).dcp_comm_s == _step("kimi-k2", 8, 1, 1_000_000).dcp_comm_s
    assert _step("kimi-k2", 8, 4, 1_000, latency_us=0).dcp_comm_s == pytest.approx(4 * step.dcp_comm_s)


def test_ag_rs_fuses_into_one_all_gather_when_latency_dominates() -> None:
    # Batch 1: one all-gather of [output|lse] costs one latency instead of two.
    small = _step("kimi-k2", 8, 1, 67_200)
    fused_bytes = 7 * 8 * 576 * 2 + 7 * 64 * (512 * 2 + 4)
    assert (small.dcp_scheme, small.dcp_collectives_per_layer) == (AG_RS_FUSED, 2)
    assert small.dcp_comm_s == pytest.approx(61 * (fused_bytes / 900e9 + 2 * 10e-6))
    # A large batch moves N times the output bytes that way: back to the reduce-scatter.
    assert _step("kimi-k2", 8, 1024, 67_200).dcp_scheme == AG_RS


@pytest.mark.parametrize("kind, ag_rs, a2a", [(HEAD_SPLIT, 3, 2), (REPLICATED, 2, 1)])
def test_a2a_needs_fewer_collectives_and_bytes(kind: str, ag_rs: int, a2a: int) -> None:
    arch = load_model("kimi-k2")
    schemes = dcp_merge_schemes(arch, layout(8, 8, kind))
    assert (len(schemes[AG_RS]), len(schemes[A2A])) == (ag_rs, a2a)
    # Each peer gets 1/8 of the 64 heads' partial outputs (512 bf16) and their LSEs.
    assert schemes[A2A][-1].bytes_per_token == 7 / 8 * 64 * (512 * 2 + 4)
    assert sum(c.bytes_per_token for c in schemes[A2A]) < sum(c.bytes_per_token for c in schemes[AG_RS])
    for batch in (1, 1024):
        by_backend = {b: _step("kimi-k2", 8, batch, 67_200, backend=b, kind=kind) for b in ("ag_rs", "a2a", "auto")}
        assert by_backend["a2a"].dcp_collectives_per_layer == a2a
        assert by_backend["a2a"].dcp_comm_s < by_backend["ag_rs"].dcp_comm_s
        assert by_backend["auto"].dcp_comm_s == by_backend["a2a"].dcp_comm_s


def test_a_slow_all_to_all_makes_auto_pick_ag_rs() -> None:
    arch, gpu, lay = load_model("kimi-k2"), load_gpu("B200", {}), layout(8, 8, REPLICATED)
    step = decode_step(arch, gpu, weight_bytes(arch), lay, kv_slot_bytes=kv_slot_bytes(arch, lay, 2), batch=4,
                       context_len=67_200, collective_latency_us=10, a2a_latency_us=30)
    assert step.dcp_scheme == AG_RS_FUSED


def test_replicated_projections_skip_the_q_all_gather() -> None:
    split, replicated = (_step("kimi-k2", 8, 64, 67_200, backend="a2a", kind=k) for k in (HEAD_SPLIT, REPLICATED))
    assert split.dcp_collectives_per_layer == 2 and replicated.dcp_collectives_per_layer == 1
    assert replicated.dcp_comm_s < split.dcp_comm_s
    assert replicated.linear_s > split.linear_s  # 8x the Q and W_UK weights streamed per rank
    assert replicated.attention_s == split.attention_s


def test_throughput_plateaus_once_kv_memory_is_full() -> None:
    _, results, _, _ = plan(SEED_ARGS)
    tp_only = results[1]
    beyond = [p for p in tp_only.curve if p.concurrency >= tp_only.max_concurrency]
    assert len(beyond) > 1
    assert {p.running_per_replica for p in beyond} == {tp_only.ceiling_per_replica}
    below = [p.step.tok_s_per_gpu for p in tp_only.curve if p.concurrency <= tp_only.max_concurrency]
    assert below == sorted(below)


# --- the seed experiment --------------------------------------------------------------


def test_seed_experiment_prediction_beside_published(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json([*SEED_ARGS, "--compare-seed"], capsys)
    rows = {row["quantity"]: row for row in doc["seed_comparison"]}
    configs = {c["dcp"]: c for c in doc["configs"] if c["attention_layout"] == HEAD_SPLIT}
    assert doc["assumptions"]["dcp_comm_backend"] == "ag_rs"  # as the seed's vLLM ran it
    ceiling = rows["TP=8 concurrency ceiling"]
    assert ceiling["published"] == "~64"
    assert ceiling["predicted"] == str(configs[1]["max_concurrency"])
    ratio = rows["DCP=8 / TP=8 tok/s/GPU"]
    assert ratio["published"] == "3.3x"
    assert ratio["predicted"] == f"{configs[8]['tok_s_per_gpu'] / configs[1]['tok_s_per_gpu']:.2f}x"
    # The numbers docs/planner.md reports (67,400 KV tokens per request, 84.8 GiB KV/GPU).
    assert configs[1]["max_concurrency"] == 19
    assert configs[8]["max_concurrency"] == 153
    assert configs[8]["tok_s_per_gpu"] / configs[1]["tok_s_per_gpu"] == pytest.approx(5.07, abs=0.01)
    assert doc["recommendation"]["dcp"] == 8


def test_dcp_comm_backend_flag_sets_the_merge(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8", "--kv-memory-gib", "46.8", "--workload", "agentic"]
    for backend, schemes in (("ag_rs", {AG_RS, AG_RS_FUSED}), ("a2a", {A2A})):
        doc = run_json([*argv, "--dcp-comm-backend", backend], capsys)
        assert {c["step"]["dcp_merge"] for c in doc["configs"] if c["dcp"] > 1} <= schemes
        assert doc["recommendation"]["comm_backend"] == backend
    # ag_rs asked for: the advice says what a2a would save.
    _, _, _, rec = plan([*argv, "--dcp-comm-backend", "ag_rs"])
    assert any(r.startswith("--dcp-comm-backend ag_rs (set; a2a would save") for r in rec.reasons)
    assert main([*SEED_ARGS, "--compare-seed", "--dcp-comm-backend", "a2a"]) == 2
    assert "leave --dcp and --dcp-comm-backend at auto" in capsys.readouterr().err


def test_compare_seed_refuses_another_setup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8", "--workload", "agentic",
                 "--compare-seed"]) == 2
    assert "--model kimi-k2.6 --gpu B200" in capsys.readouterr().err


# --- recommendations in the words of the guide ----------------------------------------


def test_short_contexts_get_no_dcp() -> None:
    _, results, _, rec = plan(["--model", "kimi-k2.6", "--gpu", "H200", "--gpus", "8",
                               "--context-len", "4000", "--output-len", "500"])
    assert rec.dcp == 1
    assert "short contexts" in rec.reasons[0]
    assert set(results) == {1, 2, 4, 8}  # still evaluated and shown


def test_mla_at_long_context_gets_dcp() -> None:
    _, results, _, rec = plan(SEED_ARGS)
    assert rec.dcp == 8 and rec.interleave_size == 1
    assert rec.reasons[0].startswith("MLA model")
    assert any("KV memory is the bottleneck" in r for r in rec.reasons)
    assert any("above the guide's 2-4" in w for w in rec.warnings)
    assert results[8].tok_s_per_gpu > results[4].tok_s_per_gpu > results[1].tok_s_per_gpu


def test_gqa_with_tp_not_above_kv_heads_gets_no_dcp_because_no_kv_copy_is_left() -> None:
    _, results, _, rec = plan(["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "8", "--workload", "agentic"])
    # The replicated layout runs dcp 2-8, but A = 8/N holds N times the heads on 1/N of
    # the tokens: the same bytes per token as tp=8 alone.
    assert set(results) == {1, 2, 4, 8}
    assert {r.memory.kv_bytes_per_token_per_gpu for r in results.values()} == {40_960}
    assert rec.dcp == 1
    assert "DCP removes no KV copy" in rec.reasons[0] and "8 KV heads" in rec.reasons[0]


def test_gqa_with_replicated_heads_gets_dcp() -> None:
    _, results, by_layout, rec = plan(["--model", "qwen3-235b-a22b", "--gpu", "B200", "--gpus", "8",
                                       "--workload", "agentic"])
    assert set(by_layout) == {(1, HEAD_SPLIT), (2, HEAD_SPLIT), (2, REPLICATED), (4, REPLICATED), (8, REPLICATED)}
    assert rec.dcp >= 2 and any("4 KV heads" in r for r in rec.reasons)


def test_llama_70b_on_16_gpus_offers_dcp_16_and_recommends_deterministically() -> None:
    argv = ["--model", "llama-3.1-70b", "--gpu", "H100", "--gpus", "16", "--tp", "16", "--workload", "agentic"]
    _, _, by_layout, rec = plan(argv)
    a1 = by_layout[(16, REPLICATED)]
    assert a1.layout.attention_tp == 1 and a1.operating is not None
    # Every group of 16 holds all 8 KV heads over 1/16 of the tokens: 80 layers x 8
    # heads x 256 values x 2 bytes / 16, the same as dcp=2, but with 16x the Q projection.
    assert a1.memory.kv_bytes_per_token_per_gpu == 80 * 8 * 256 * 2 / 16 == 20_480
    assert a1.memory.weight_bytes_per_gpu > by_layout[(2, HEAD_SPLIT)].memory.weight_bytes_per_gpu
    again = plan(argv)[3]
    assert rec == again
    assert (rec.dcp, rec.attention_tp, rec.attention_layout, rec.comm_backend) == (2, 8, REPLICATED, "a2a")


def test_a_model_that_tp_alone_cannot_run_gets_dcp(tmp_path: Path) -> None:
    # 9 query heads at tp=6: attention-TP 6 splits no head evenly, so dcp=1 cannot run;
    # dcp=2 (A=3) and dcp=6 (A=1) can, with replicated projections.
    _, results, by_layout, rec = plan(["--model", small_gqa_config(tmp_path), "--gpu", "H100", "--gpus", "6",
                                       "--context-len", "100000", "--output-len", "1000"])
    assert set(by_layout) == {(2, REPLICATED), (6, REPLICATED)}
    assert rec.dcp in (2, 6) and rec.reasons[0].startswith("dcp=1 cannot run: attention-TP A = 6/1 = 6")


def test_without_nvlink_no_dcp() -> None:
    _, _, _, rec = plan([*SEED_ARGS, "--nvlink-gbps", "0"])
    assert rec.dcp == 1 and "no NVLink" in rec.reasons[0]


def test_dcp_beyond_a_node_is_warned() -> None:
    _, _, _, rec = plan(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--tp", "16", "--dcp", "16",
                      "--workload", "agentic"])
    assert any("spans more than one node" in w for w in rec.warnings)


# --- prefill and disaggregation ----------------------------------------------------


def _prefill(model: str, input_len: int, tp: int = 8, dcp: int = 1, kind: str = HEAD_SPLIT,
             efficiency: float = 0.5, chunk: int = 8192):
    arch, gpu = load_model(model), load_gpu("H200", {})
    lay = layout(tp, dcp, kind)
    return prefill_time(arch, gpu, weight_bytes(arch), lay, kv_slot_bytes=kv_slot_bytes(arch, lay, 2),
                        input_len=input_len, chunk_tokens=chunk, efficiency=efficiency, collective_latency_us=10.0)


@pytest.mark.parametrize("model", ["llama-3.1-70b", "deepseek-v3"])
def test_prefill_time_grows_linearly_then_quadratically_with_the_prompt(model: str) -> None:
    short, double_short = _prefill(model, 2048), _prefill(model, 4096)
    long, double_long = _prefill(model, 1_000_000), _prefill(model, 2_000_000)
    # Short prompts: the linear layers' 2 x active params FLOPs per token dominate.
    assert 1.9 < double_short.total_s / short.total_s < 2.2
    # Long prompts: causal attention's ~L^2 / 2 (query, key) pairs take over.
    assert 3.5 < double_long.total_s / long.total_s < 4.0
    assert double_long.attention_s / long.attention_s == pytest.approx(4, rel=0.01)
    assert double_long.linear_s / long.linear_s == pytest.approx(2, rel=0.01)
    # Chunking keeps the (query, key) pairs; MLA also up-projects the cached latents
    # once per chunk, so smaller chunks cost it more.
    whole, chunked = _prefill(model, 65_536, chunk=65_536), _prefill(model, 65_536, chunk=8192)
    if load_model(model).is_mla:
        assert chunked.attention_s > whole.attention_s * 1.02
    else:
        assert chunked.attention_s == pytest.approx(whole.attention_s, rel=0.001)


def test_prefill_is_compute_bound_at_the_stated_efficiency() -> None:
    arch, gpu = load_model("llama-3.1-70b"), load_gpu("H200", {})
    full, half = _prefill("llama-3.1-70b", 65_536, efficiency=1.0), _prefill("llama-3.1-70b", 65_536, efficiency=0.5)
    assert half.linear_s == pytest.approx(2 * full.linear_s) and half.attention_s == pytest.approx(2 * full.attention_s)
    # At peak, the linear layers take 2 x active params x tokens / tp over the BF16 rate.
    assert full.linear_s == pytest.approx(2 * arch.active_params_per_token() * 65_536 / 8 / (gpu.bf16_tflops * 1e12))
    assert full.num_chunks == 8 and full.chunk_s == tuple(sorted(full.chunk_s))  # later chunks see more context


def test_disaggregated_ttft_is_prefill_plus_kv_transfer_plus_one_step(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--workload", "agentic", "--dcp", "8",
            "--disaggregate", "8:8"]
    doc = run_json(base, capsys)["disaggregation"]["disaggregated"]
    # The decode side holds the latent once per DCP group; every decode rank receives
    # its 1/8 of the prompt's tokens, the 8 prefill ranks send the 8 shares between them.
    per_rank = 67_000 * 70_272 / 8
    assert doc["kv_transfer_bytes"] == pytest.approx(8 * per_rank)
    # 16 GPUs span two nodes: the KV crosses the 50 GB/s network.
    assert doc["kv_transfer_ms"] == pytest.approx((per_rank / 50e9 + 10e-6) * 1e3)
    assert doc["ttft_s"] == pytest.approx(doc["prefill_s"] + doc["kv_transfer_ms"] / 1e3 + doc["decode_step_ms"] / 1e3)
    slow = run_json([*base, "--network-gbps", "12.5"], capsys)["disaggregation"]["disaggregated"]
    assert slow["ttft_s"] - doc["ttft_s"] == pytest.approx(3 * per_rank / 50e9)
    # Both sides in one node: NVLink.
    one_node = run_json(["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "8", "--tp", "4", "--workload",
                         "agentic", "--disaggregate", "4:4"], capsys)["disaggregation"]["disaggregated"]
    assert one_node["kv_transfer_ms"] == pytest.approx((67_000 * 80 * 2 * 2 * 128 * 2 / 450e9 + 10e-6) * 1e3)


def test_too_few_prefill_gpus_are_prefill_limited(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "16", "--tp", "2"]
    long_prompts = run_json([*base, "--workload", "agentic", "--disaggregate", "2:14"], capsys)["disaggregation"]
    d = long_prompts["disaggregated"]
    assert d["limit"] == "prefill" and d["rps"] == d["prefill_rps"] < d["decode_rps"]
    assert d["prefill_rps"] == pytest.approx(1 / d["prefill_s"])  # one prefill instance of tp=2
    assert d["output_tok_s_per_gpu"] == pytest.approx(d["rps"] * 400 / 16)
    # More prefill GPUs move the limit to decode.
    many = run_json([*base, "--workload", "agentic", "--disaggregate", "14:2"], capsys)["disaggregation"]
    assert many["disaggregated"]["prefill_rps"] == pytest.approx(7 * d["prefill_rps"])
    assert many["disaggregated"]["output_tok_s_per_gpu"] > d["output_tok_s_per_gpu"]
    # Short prompts and long answers: the same 2:14 split is decode-limited.
    chat = run_json([*base, "--context-len", "1000", "--output-len", "4000", "--disaggregate", "2:14"], capsys)
    assert chat["disaggregation"]["disaggregated"]["limit"] == "decode"


def test_colocated_time_shares_prefill_and_decode_and_pays_a_chunk_in_itl(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--workload", "agentic", "--dcp", "8",
                    "--disaggregate", "8:8"], capsys)
    colo, disagg = doc["disaggregation"]["colocated"], doc["disaggregation"]["disaggregated"]
    assert colo["rps"] == pytest.approx(1 / (1 / colo["prefill_rps"] + 1 / colo["decode_rps"]))
    config = next(c for c in doc["configs"] if c["dcp"] == colo["decode_dcp"]
                  and c["attention_layout"] == colo["decode_attention_layout"])
    assert colo["prefill_s"] == config["prefill"]["prefill_s"] and colo["decode_step_ms"] == config["step"]["step_ms"]
    # Every decode step of this workload carries a chunk (9 chunks per request against
    # 400 / 69 steps): p99 is a step with the longest chunk, p50 one with a mean chunk.
    assert colo["chunk_step_share"] == 1.0
    assert colo["itl_p99_ms"] == pytest.approx(colo["decode_step_ms"] + config["prefill"]["longest_chunk_ms"])
    assert colo["itl_p50_ms"] == pytest.approx(colo["decode_step_ms"] + 1e3 * colo["prefill_s"] / 9)
    assert disagg["itl_p50_ms"] == disagg["itl_p99_ms"] == disagg["decode_step_ms"] == colo["decode_step_ms"]
    assert colo["ttft_s"] == pytest.approx(colo["prefill_s"] + 9 * colo["decode_step_ms"] / 1e3)
    # Half the GPUs decode: half the decode capacity and concurrency.
    assert disagg["decode_rps"] == pytest.approx(colo["decode_rps"] / 2)
    assert disagg["decode_concurrency"] * 2 == colo["decode_concurrency"]
    assert doc["disaggregation"]["throughput_ratio"] == pytest.approx(
        disagg["output_tok_s_per_gpu"] / colo["output_tok_s_per_gpu"])


def test_balanced_split_equalizes_both_sides() -> None:
    inputs = build_inputs(parse(["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "16", "--tp", "2",
                                 "--workload", "agentic"]))
    results, _ = evaluate(inputs)
    comparison = compare(inputs, results[0], Split(8, 8, 2))
    share, d = comparison.balanced_prefill_share, comparison.disaggregated
    # Rates grow with GPUs: at the balanced share both sides sustain the same req/s.
    prefill_per_gpu, decode_per_gpu = d.prefill_rps / 8, d.decode_rps / 8
    assert share * 16 * prefill_per_gpu == pytest.approx((1 - share) * 16 * decode_per_gpu)


def test_disaggregation_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--workload", "agentic",
                    "--disaggregate", "8:8"], capsys)
    fields = {"gpus", "prefill_gpus", "decode_gpus", "prefill_tp", "prefill_dcp", "decode_tp", "decode_dcp",
              "decode_attention_layout", "prefill_s", "prefill_chunks", "prefill_rps", "decode_concurrency",
              "decode_step_ms", "decode_rps", "rps", "limit", "kv_transfer_bytes", "kv_transfer_ms", "ttft_s",
              "itl_p50_ms", "itl_p99_ms", "chunk_step_share", "output_tok_s_per_gpu"}
    section = doc["disaggregation"]
    assert set(section["colocated"]) == set(section["disaggregated"]) == fields
    assert (section["disaggregated"]["prefill_gpus"], section["disaggregated"]["decode_gpus"]) == (8, 8)
    assert section["colocated"]["kv_transfer_ms"] == 0 and 0 < section["balanced_prefill_share"] < 1
    assert doc["assumptions"]["prefill_efficiency"] == 0.5 and doc["assumptions"]["max_num_batched_tokens"] == 8192
    assert all(c["prefill"]["prefill_s"] > 0 for c in doc["configs"])
    assert "disaggregation" not in run_json(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16",
                                             "--workload", "agentic"], capsys)


def test_disaggregation_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "llama-3.1-70b", "--gpu", "H200", "--gpus", "16", "--workload", "agentic",
                 "--disaggregate", "8:8"]) == 0
    out = capsys.readouterr().out
    assert "colocated vs disaggregated" in out and "ITL p50 / p99" in out and "limited by" in out
    assert "the two sides balance with" in out


@pytest.mark.parametrize("extra, message", [
    (["--disaggregate", "8"], "--disaggregate '8': give PREFILL_GPUS:DECODE_GPUS"),
    (["--disaggregate", "a:b"], "--disaggregate 'a:b': give PREFILL_GPUS:DECODE_GPUS"),
    (["--disaggregate", "0:16"], "two whole numbers of at least 1 that add up to --gpus 16, e.g. 8:8"),
    (["--disaggregate", "8:9"], "8 + 9 = 17 GPUs, but --gpus is 16"),
    (["--disaggregate", "12:4"], "tp=8 does not divide the 4 decode GPUs"),
    (["--disaggregate", "8:8", "--prefill-tp", "3"], "--prefill-tp 3 does not divide its GPU count 8"),
    (["--disaggregate", "8:8", "--prefill-tp", "0"], "--prefill-tp must be positive"),
    (["--prefill-tp", "8"], "give --disaggregate too"),
    (["--prefill-efficiency", "1.5"], "--prefill-efficiency must be in (0, 1]"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be positive"),
])
def test_bad_disaggregation_flags_are_one_line_errors(extra: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--workload", "agentic", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshard plan: error: ") and message in err


def test_prefill_side_too_small_for_the_model_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "deepseek-v3", "--gpu", "H200", "--gpus", "16", "--workload", "agentic",
                 "--disaggregate", "8:8", "--prefill-tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prefill side of --disaggregate" in err and "--prefill-tp" in err


# --- command line ---------------------------------------------------------------------


def test_table_output(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # the table's width follows the terminal's (pytest-xdist workers say 80)
    assert run_plan(parse(SEED_ARGS)) == 0
    out = capsys.readouterr().out
    assert "tp=8 dcp=8 A=1" in out and " *" in out and "recommendation" in out and "KV memory" in out


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["--model", "deepseek-v2-lite", "--gpu", "H100", "--gpus", "8", "--tp", "4",
                    "--context-len", "40000", "--output-len", "1000"], capsys)
    assert doc["cluster"] == {"num_gpus": 8, "tp": 4, "replicas": 2}
    assert [(c["dcp"], c["attention_layout"]) for c in doc["configs"]] == [
        (1, HEAD_SPLIT), (2, HEAD_SPLIT), (2, REPLICATED), (4, HEAD_SPLIT), (4, REPLICATED)]
    first = doc["configs"][0]
    assert first["kv_bytes_per_token_per_gpu"] == 27 * 576 * 2
    assert first["max_concurrency"] == 2 * (first["kv_capacity_tokens"] // 41_000)
    assert first["step"]["step_ms"] > 0 and first["curve"][0]["concurrency"] == 2
    assert doc["recommendation"]["dcp"] in (2, 4)


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.png"
    assert main([*SEED_ARGS, "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().err


def test_custom_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(["--model", "llama-3.1-70b", "--gpu", "custom", "--hbm-gib", "96", "--hbm-tbps", "4",
                    "--bf16-tflops", "900", "--nvlink-gbps", "450", "--gpus", "4", "--workload", "agentic"], capsys)
    assert doc["gpu"]["hbm_gib"] == 96 and doc["gpu"]["fp8_tflops"] == 900


@pytest.mark.parametrize("argv, message", [
    (["--model", "nope", "--gpu", "B200", "--gpus", "8", "--workload", "agentic"], "use one of deepseek-v2-lite"),
    (["--model", "/no/such/config.json", "--gpu", "B200", "--gpus", "8", "--workload", "agentic"],
     "neither an existing config.json"),
    (["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8", "--tp", "3", "--workload", "agentic"],
     "--tp 3 does not divide --gpus 8"),
    (["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8", "--dcp", "3", "--workload", "agentic"],
     "--dcp 3 does not divide --tp 8"),
    (["--model", "kimi-k2", "--gpu", "custom", "--gpus", "8", "--hbm-gib", "80", "--workload", "agentic"],
     "--gpu custom needs --hbm-tbps, --bf16-tflops, --nvlink-gbps"),
    (["--model", "kimi-k2", "--gpu", "H100", "--gpus", "8", "--workload", "agentic"], "raise --tp and --gpus"),
    (["--model", "kimi-k2", "--gpu", "H200", "--gpus", "8", "--kv-memory-gib", "46.8", "--workload", "agentic"],
     "exceeds the 141 GiB of a H200"),
    (["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8"], "give --workload agentic or both"),
    (["--model", "kimi-k2", "--gpu", "B200", "--gpus", "8", "--workload", "chat"], "unknown workload"),
    (["--model", "kimi-k2", "--gpu", "B300", "--gpus", "8", "--workload", "agentic"], "unknown GPU 'B300'"),
])
def test_user_errors_are_one_line_and_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvshard plan: error: ")
    assert message in err


@pytest.mark.parametrize("cluster, message", [
    (["--gpus", "4", "--dcp", "2"], "at tp=4: attention-TP A = 4/2 = 2 does not divide the 9 query heads; "
                                    "use --dcp auto"),
    (["--gpus", "9", "--tp", "9"], "--tp 9 does not divide the MLP width 1,536"),
    (["--gpus", "2", "--dcp", "1"], "--dcp 1 cannot run"),
])
def test_layout_errors_name_the_rule(cluster: list[str], message: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", small_gqa_config(tmp_path), "--gpu", "H100", "--workload", "agentic", *cluster]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_python_m_entry_point_and_no_torch() -> None:
    bad = subprocess.run([sys.executable, "-m", "kvshard.planner", "--model", "nope", "--gpu", "B200",
                          "--gpus", "8", "--workload", "agentic"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "unknown" not in bad.stdout
    # Load the planner without running kvshard/__init__.py, which brings in the engine:
    # the planner itself must need neither torch nor (until --plot) matplotlib.
    probe = ("import sys, types; package = types.ModuleType('kvshard'); "
             f"package.__path__ = [{str(REPO / 'kvshard')!r}]; sys.modules['kvshard'] = package; "
             "import kvshard.planner.cli; "
             "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"
