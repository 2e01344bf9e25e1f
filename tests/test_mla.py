"""MLA models (DeepSeek-V2/V3, Kimi K2) with the latent cache sharded by sequence.

Three tiny random checkpoints, written by transformers' own save_pretrained, are
the reference: kvshard must produce the tokens (and log-probabilities) of
transformers' greedy `generate`, with and without DCP, with and without Q
replication, while each rank stores 1/N of the latent cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from kvshard import LLM, ConfigError, SamplingParams
from kvshard.config import EngineConfig
from kvshard.engine.arg_utils import EngineArgs

from conftest import assert_same_generation, engine_after_run

BLOCK_SIZE = 4  # a virtual block at dcp=4 is 16 tokens: the longer prompts span several
NEW_TOKENS = 32
PROMPT_LENGTHS = [3, 21, 37]
LOGPROB_TOP = 5

_SHAPE = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
    num_key_value_heads=8, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
    # large weights keep greedy choices well apart, so float rounding cannot flip them
    initializer_range=0.3,
)
_MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1)
# name -> (config, weight seed); seeds chosen so that transformers' greedy choices are
# at least 1e-2 apart in log-probability (kvshard's rounding differs by ~1e-5)
CONFIGS = {
    # V3 as DeepSeek-V3 / Kimi K2 ship it: Q LoRA, sigmoid routing with correction bias over
    # expert groups, renormalised and scaled weights, interleaved RoPE, YaRN with mscale.
    "v3-moe": (DeepseekV3Config(
        **_SHAPE, **_MOE, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
    ), 3),
    # V3 with every layer dense, Q projected directly, RoPE on halves, no scaling.
    "v3-dense": (DeepseekV3Config(
        **_SHAPE, q_lora_rank=None, first_k_dense_replace=3, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ), 0),
    # 6 heads: at tp=4 a DCP group of 4 (or 2) holds 6 (or 3) heads, so a rank's share of the output
    # ends inside a head (only the replicated layout runs it).
    "v3-6heads": (DeepseekV3Config(
        **{**_SHAPE, "num_attention_heads": 6}, q_lora_rank=None, first_k_dense_replace=3, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ), 1),
    # V2(-Lite): softmax routing limited to the best groups, two shared experts, YaRN as V2 ships it.
    "v2-moe": (DeepseekV2Config(
        **_SHAPE, **_MOE, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                         "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707},
    ), 1),
}


@dataclass(frozen=True)
class Layout:
    tp: int
    dcp: int
    interleave: int = 1
    attention: str = "auto"  # dcp_attention_layout
    env: tuple[tuple[str, str], ...] = ()  # environment the ranks start with
    comm: str = "auto"  # dcp_comm_backend
    expert_parallel: bool = False  # enable_expert_parallel: whole routed experts per rank, not every expert split

    def __str__(self) -> str:
        return (f"tp{self.tp}-dcp{self.dcp}-i{self.interleave}" + (f"-{self.attention}" if self.attention != "auto" else "")
                + "".join(f"-{name}={value}" for name, value in self.env) + (f"-{self.comm}" if self.comm != "auto" else "")
                + ("-ep" if self.expert_parallel else ""))


# Each tp=4 start costs ~10 s here, so the layouts cover the features instead of the full cross
# product: every config runs unsharded (tp=1, the DCP baseline) and at tp=4 with dcp=2 and dcp=4,
# one of them with interleave 1 and the other with interleave = block size, alternating between
# configs; V2 (its routing and YaRN are model code, the same at any dcp) runs at dcp=2 only, its
# dcp=4 layout (head-split, interleave = block size) runs on the V3 MoE config. The replicated layout (every rank computes its group's queries) runs on the MoE config at
# dcp=2, where there are two DCP groups, so the second group's slice of heads is exercised, and on
# the dense config at dcp=4 next to its head-split run. tp=4 without DCP (4 replicated latents) runs
# on the dense config, which also carries the accounting checks at dcp 1, 2 and 4. The MoE configs' tp=4 runs
# split every routed expert by width (the default); V2's second layout puts whole experts on each rank
# (--enable-expert-parallel) with its group-limited routing.
RUNS: dict[str, list[Layout]] = {
    "v3-moe": [Layout(1, 1), Layout(4, 2, 1, "replicated"), Layout(4, 4, BLOCK_SIZE)],
    "v3-dense": [Layout(1, 1), Layout(4, 1), Layout(4, 2, BLOCK_SIZE), Layout(4, 4, 1), Layout(4, 4, 1, "replicated")],
    "v2-moe": [Layout(1, 1), Layout(4, 2, 1), Layout(4, 2, BLOCK_SIZE, expert_parallel=True)],
    # at KVSHARD_FUSED_MERGE_MAX_BYTES=0 a GQA merge would reduce-scatter features; W_UV needs whole heads' latents
    "v3-6heads": [Layout(1, 1), Layout(4, 4, 1), Layout(4, 2, BLOCK_SIZE, env=(("KVSHARD_FUSED_MERGE_MAX_BYTES", "0"),
                                                                                ("KVSHARD_A2A_MAX_BYTES", "0")))],
}
SHARDED_RUNS = [(name, layout) for name, layouts in RUNS.items() for layout in layouts if layout.tp > 1]
ALL_RUNS = [(name, layout) for name, layouts in RUNS.items() for layout in layouts]
ACCOUNTING_PROMPT_LEN = 32  # a multiple of dcp * block size: every DCP rank holds exactly 1/N of it


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(2, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@dataclass
class Generation:
    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]]]  # per prompt, per new token: {token_id: logprob}


@dataclass
class Run:
    generation: Generation
    config: EngineConfig
    kv_cache_bytes: int  # allocated on rank 0
    kv_tokens_per_dcp_rank: list[int]  # with one request of ACCOUNTING_PROMPT_LEN tokens in the cache
    q_rows_on_rank0: int  # output rows of rank 0's Q projection (first layer)
    merges: set[str]  # the merge schemes rank 0's layers took (empty without DCP)
    expert_shapes: list[tuple[int, ...]]  # rank 0's routed experts' w13_weight, per MoE layer


def _accounting(llm: LLM) -> tuple[list[int], set[str], int, list[tuple[int, ...]]]:
    """After the batch: the KV tokens per DCP rank of one live request, the merges taken, rank 0's Q rows and
    routed experts' shapes."""
    engine = llm.engine
    engine.add_request("accounting", list(range(2, 2 + ACCOUNTING_PROMPT_LEN)), SamplingParams(max_tokens=4))
    live = engine.requests["accounting"].seqs[0]
    while live.num_computed_tokens < ACCOUNTING_PROMPT_LEN:  # prefilled, still running
        engine.step()
    kv_tokens, timing = engine.stats().kv_tokens_per_dcp_rank, engine.stats().dcp_timing
    engine.abort_request("accounting")
    attention = engine.runner.model.model.layers[0].self_attn
    q_proj = attention.q_b_proj if attention.q_lora else attention.q_proj
    experts = [tuple(layer.mlp.experts.w13_weight.shape) for layer in engine.runner.model.model.layers
               if hasattr(layer.mlp, "experts")]
    return kv_tokens, set(timing.merges) if timing else set(), q_proj.weight_shape[0], experts


def _run(engine_run, directory: Path, layout: Layout, prompts: list[list[int]], dtype: str = "auto") -> Run:
    result = engine_run(
        directory, prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=LOGPROB_TOP),
        env=dict(layout.env), probe=_accounting,
        tensor_parallel_size=layout.tp, decode_context_parallel_size=layout.dcp,
        dcp_kv_interleave_size=layout.interleave, dcp_attention_layout=layout.attention, block_size=BLOCK_SIZE,
        dcp_comm_backend=layout.comm, enable_expert_parallel=layout.expert_parallel,
        max_model_len=128, num_kv_blocks=64, max_num_seqs=4,
        max_num_batched_tokens=16,  # long prompts prefill in chunks that attend to the sharded cache
        dtype=dtype,
    )
    kv_tokens, merges, q_rows, experts = result.probed
    return Run(Generation(result.tokens, result.logprobs), result.config, result.kv_cache_bytes, kv_tokens, q_rows,
               merges, experts)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts()


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    def get(name: str) -> Path:
        config, seed = CONFIGS[name]
        return checkpoints(f"mla-{name}", config, seed, off_neutral=True)

    return get


@pytest.fixture(scope="module")
def reference(checkpoint, prompts, hf_reference):
    made: dict[str, Generation] = {}

    def get(name: str) -> Generation:
        if name not in made:
            tokens, steps = hf_reference(checkpoint(name), prompts, NEW_TOKENS, logprobs=True)
            made[name] = Generation(tokens, [[{i: float(row[i]) for i in range(row.shape[0])} for row in rows]
                                             for rows in steps])
        return made[name]

    return get


@pytest.fixture(scope="module")
def run(checkpoint, prompts, engine_run):
    """run(config name, layout) -> Run, each engine started once per session."""

    def get(name: str, layout: Layout, dtype: str = "auto") -> Run:
        return _run(engine_run, checkpoint(name), layout, prompts, dtype)

    return get


@pytest.mark.parametrize("name, layout", ALL_RUNS, ids=[f"{n}-{l}" for n, l in ALL_RUNS])
def test_greedy_tokens_match_transformers(run, reference, name, layout):
    got, want = run(name, layout).generation, reference(name)
    # absorbed vs expanded attention: same math, other float rounding
    assert_same_generation(got.tokens, got.logprobs, want.tokens, want.logprobs, atol=1e-3, same_candidates=False)


@pytest.mark.parametrize("name", ["v2-moe", "v3-moe"])
def test_routed_experts_split_by_width_unless_expert_parallel(run, name):
    """Rank 0's routed experts at tp=4: every expert with a quarter of its width, or with --enable-expert-parallel
    two whole experts of the eight (the runs above check both against transformers)."""
    hidden, width, experts = _SHAPE["hidden_size"], _MOE["moe_intermediate_size"], _MOE["n_routed_experts"]
    for layout in RUNS[name]:
        if layout.tp == 4:
            shapes = run(name, layout).expert_shapes
            want = (experts // 4, 2 * width, hidden) if layout.expert_parallel else (experts, 2 * width // 4, hidden)
            assert shapes and set(shapes) == {want}, (layout, shapes)


@pytest.mark.parametrize("name, layout", SHARDED_RUNS, ids=[f"{n}-{l}" for n, l in SHARDED_RUNS])
def test_sharded_run_equals_unsharded_run(run, name, layout):
    sharded, single = run(name, layout).generation, run(name, Layout(1, 1)).generation
    # the same top-k candidates with the same log-probabilities
    assert_same_generation(sharded.tokens, sharded.logprobs, single.tokens, single.logprobs, atol=2e-4)


def test_canonical_merge_and_split_decode_groups_match_transformers(run, reference):
    """Tiny models stay below the fused merge's threshold and the decode-group spread: at 0 the
    latent's merge takes the LSE all-gather + ReduceScatter path, decodes attend in groups by length."""
    layout = Layout(2, 2, env=(("KVSHARD_DECODE_GROUP_SPREAD", "0"), ("KVSHARD_FUSED_MERGE_MAX_BYTES", "0"),
                               ("KVSHARD_A2A_MAX_BYTES", "0")))
    got, single = run("v3-dense", layout).generation, run("v3-dense", Layout(1, 1)).generation
    want = reference("v3-dense")
    assert_same_generation(got.tokens, got.logprobs, want.tokens, want.logprobs, atol=1e-3, same_candidates=False)
    assert_same_generation(got.tokens, got.logprobs, single.tokens, single.logprobs, atol=2e-4)


# Tiny models' merges are small: --dcp-comm-backend auto takes the all-to-all, ag_rs its fused
# all-gather; both merge the same [latent | lse] rows in the same order, so the bits are equal.
@pytest.mark.parametrize("layout", [Layout(2, 2), Layout(4, 4), Layout(4, 2, BLOCK_SIZE)], ids=str)
def test_all_to_all_merge_equals_ag_rs_bit_for_bit(run, reference, layout):
    a2a, ag_rs = run("v3-dense", layout), run("v3-dense", replace(layout, comm="ag_rs"))
    assert a2a.merges == {"a2a"} and ag_rs.merges == {"ag_rs fused"}
    assert a2a.generation.tokens == ag_rs.generation.tokens == reference("v3-dense").tokens
    assert a2a.generation.logprobs == ag_rs.generation.logprobs


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(2, 2)], ids=str)
def test_bfloat16_runs_close_to_float32(run, layout):
    """bfloat16 weights, cache and activations (attention merged in float32): each prompt's first
    token (from the prefill alone, chunked, so chunks attend to the cache) is one of float32's top
    five, with a log-probability within 0.15 of float32's; every request runs to the end."""
    base = run("v3-moe", Layout(1, 1)).generation
    low = run("v3-moe", layout, "bfloat16").generation
    for tokens, logprobs, base_logprobs in zip(low.tokens, low.logprobs, base.logprobs):
        assert len(tokens) == NEW_TOKENS
        first = tokens[0]
        assert first in base_logprobs[0]
        assert logprobs[0][first] == pytest.approx(base_logprobs[0][first], abs=0.15)


@pytest.mark.parametrize("name, dcp, interleave", [("v3-moe", 2, 1), ("v3-dense", 4, 1)])
def test_replicated_layout_projects_the_whole_dcp_group_and_changes_nothing(run, name, dcp, interleave):
    cfg = CONFIGS[name][0]
    replicated = run(name, Layout(4, dcp, interleave, "replicated"))
    assert replicated.config.parallel.attention_layout == "replicated"
    heads_per_rank = cfg.num_attention_heads // 4
    qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    assert replicated.q_rows_on_rank0 == dcp * heads_per_rank * qk_head_dim  # the group's heads, no Q all-gather
    head_split = run(name, next(l for l in RUNS[name] if l.tp == 4 and l.dcp > 1 and l.attention == "auto"))
    assert head_split.config.parallel.attention_layout == "head-split"  # auto's choice for MLA
    assert head_split.q_rows_on_rank0 == heads_per_rank * qk_head_dim
    assert replicated.generation.tokens == head_split.generation.tokens
    single = run(name, Layout(1, 1)).generation
    assert_same_generation(replicated.generation.tokens, replicated.generation.logprobs, single.tokens,
                           single.logprobs, atol=2e-4)


def test_six_heads_run_only_in_the_replicated_layout(run, checkpoint):
    for layout in RUNS["v3-6heads"][1:]:
        assert run("v3-6heads", layout).config.parallel.attention_layout == "replicated"
    with pytest.raises(ConfigError, match="head-split needs tensor_parallel_size=4 to divide the 6 query heads"):
        EngineArgs(str(checkpoint("v3-6heads")), tensor_parallel_size=4, decode_context_parallel_size=4,
                   dcp_attention_layout="head-split").create_engine_config()


def _latent_bytes_per_token(name: str) -> int:
    cfg = CONFIGS[name][0]
    return cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # float32, [c_kv | k_pe]


@pytest.mark.parametrize("dcp", [2, 4])
def test_per_rank_latent_bytes_are_one_nth_of_dcp1(run, dcp):
    layouts = {layout.dcp: layout for layout in RUNS["v3-dense"] if layout.tp == 4}
    base, sharded = run("v3-dense", layouts[1]), run("v3-dense", layouts[dcp])
    full = _latent_bytes_per_token("v3-dense")
    assert base.config.kv_bytes_per_token_per_rank == full
    assert sharded.config.kv_bytes_per_token_per_rank == full / dcp
    # what rank 0 allocated: the latent only (the value is a view of it), the same memory at every dcp ...
    for r in (base, sharded):
        assert r.kv_cache_bytes == r.config.num_kv_blocks * BLOCK_SIZE * full
    # ... holding dcp times the tokens, so the bytes one token costs a rank shrink by 1/dcp
    assert sharded.config.kv_capacity_tokens == dcp * base.config.kv_capacity_tokens
    assert sharded.kv_cache_bytes / sharded.config.kv_capacity_tokens == full / dcp
    # a live request: each DCP rank stores exactly 1/dcp of its tokens
    assert base.kv_tokens_per_dcp_rank == [ACCOUNTING_PROMPT_LEN]
    assert sharded.kv_tokens_per_dcp_rank == [ACCOUNTING_PROMPT_LEN // dcp] * dcp


def test_startup_report_says_how_the_routed_experts_split():
    from kvshard.config.report import startup_report

    def line(model: str = "kvshard-demo", **args) -> list[str]:
        config = EngineArgs(model, max_model_len=2048, kv_cache_memory="8MiB", **args).create_engine_config()
        return [text for text in startup_report(config).splitlines() if text.startswith("routed experts:")]

    assert line() == ["routed experts: all 8 whole on the one rank"]
    assert line(tensor_parallel_size=2) == [
        "routed experts: each of the 8 split over the 2 rank(s) by width (64 of its 128 intermediate rows per rank; "
        "--enable-expert-parallel puts whole experts on each rank)"]
    assert line(tensor_parallel_size=2, enable_expert_parallel=True) == [
        "routed experts: expert parallel, 4 whole experts of the 8 per rank (--enable-expert-parallel; a step waits "
        "for the rank whose experts got the most tokens)"]
    assert line(model="kvshard-demo-gqa") == []  # no experts, no line


def test_tp_without_dcp_reports_a_full_latent_copy_on_every_rank(run):
    tp_only = run("v3-dense", Layout(4, 1))
    full = _latent_bytes_per_token("v3-dense")
    assert tp_only.config.kv_bytes_per_slot == full  # not full / 4: the latent cannot be split by heads
    assert tp_only.config.kv_bytes_per_token_per_rank == full
    assert tp_only.config.kv_capacity_tokens == tp_only.config.num_kv_blocks * BLOCK_SIZE
    assert f"KV bytes per token per rank: {full:,.1f}" in tp_only.config.layout_report()
    assert "MLA" in tp_only.config.layout_report()


def test_default_demo_is_a_small_deepseek_v3_moe():
    config = EngineArgs("kvshard-demo", tensor_parallel_size=2, decode_context_parallel_size=2).create_engine_config()
    hf = config.model.hf_config
    assert config.model.architecture == "DeepseekV3ForCausalLM" and config.model.is_mla
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.n_shared_experts, hf.first_k_dense_replace) == (8, 2, 1, 1)
    assert config.kv_bytes_per_token_per_rank == hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4 / 2
    with LLM("kvshard-demo", max_model_len=256, num_kv_blocks=32) as llm:
        out = llm.generate(["Hello, world!"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


# Long chunks after cached context read it in the expanded form: keys and values per head, up-projected from the cached
# latents, instead of the absorbed queries over the latents (models/deepseek.py, `_expanded_context`). The demo's bound
# is 64 rows; KVSHARD_MLA_EXPANDED_MIN_ROWS=17 brings it to these prompts. With chunks of 40 tokens the 30-token prompt
# continues with 28 rows after 2 cached tokens (ranks that hold none of them: the rank's part is empty) and the 50-token
# one with 39 rows after 11, next to a first chunk and decodes.
EXPANDED_PROMPT_LENGTHS = [38, 30, 50]


def _triton_unavailable() -> str | None:
    from kvshard.attention import triton_paged

    return triton_paged.available()


EXPANDED_RUNS = [
    ("v3-moe", Layout(1, 1), {}),
    ("v3-moe", Layout(1, 1), {"attention_backend": "gather"}),  # PyTorch's kernels, not the paged one
    # the GPU's backend, under Triton's interpreter here (tests/conftest.py turns it on where no GPU is found)
    pytest.param("v3-moe", Layout(1, 1), {"attention_backend": "triton"},
                 marks=pytest.mark.skipif(_triton_unavailable() is not None, reason=str(_triton_unavailable()))),
    ("v3-moe", Layout(4, 2, 1, "replicated"), {}),
    ("v3-dense", Layout(4, 4, BLOCK_SIZE, "replicated"), {}),
    # head-split: the group all-gathers the request's latents; each rank attends with its own heads, nothing merged
    ("v3-moe", Layout(4, 2, BLOCK_SIZE, "head-split"), {}),
    ("v3-dense", Layout(4, 4, 1, "head-split"), {}),
    # a rank's share of the output ends inside a head: the expanded rows' merge reduce-scatters features
    ("v3-6heads", Layout(4, 2, BLOCK_SIZE, env=(("KVSHARD_FUSED_MERGE_MAX_BYTES", "0"), ("KVSHARD_A2A_MAX_BYTES", "0"))),
     {}),
]


def _expanded_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(2, 128, (n,), generator=generator).tolist() for n in EXPANDED_PROMPT_LENGTHS]


def _expanded_run(checkpoint, monkeypatch, name: str, layout: Layout, min_rows: int, **extra):
    """(the Run, the long chunks of each call rank 0's layers made of the two-form context path)."""
    from kvshard.attention import backend

    taken = []
    both_forms = backend.Attention._context_in_both_forms

    def counted(self, q_context, cache, meta, value_map, expanded, long, *args, **kwargs):
        taken.append(len(long))
        return both_forms(self, q_context, cache, meta, value_map, expanded, long, *args, **kwargs)

    monkeypatch.setattr(backend.Attention, "_context_in_both_forms", counted)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=LOGPROB_TOP)
    env = dict(layout.env, KVSHARD_MLA_EXPANDED_MIN_ROWS=str(min_rows))
    engine = dict(tensor_parallel_size=layout.tp, decode_context_parallel_size=layout.dcp,
                  dcp_kv_interleave_size=layout.interleave, dcp_attention_layout=layout.attention,
                  block_size=BLOCK_SIZE, max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=40,
                  **extra)
    with engine_after_run(LLM, str(checkpoint(name)), _expanded_prompts(), params, env, None, engine) as (_, got):
        pass
    monkeypatch.undo()
    return got, taken


def _run_id(run) -> str:
    name, layout, extra = run.values if hasattr(run, "values") else run
    return f"{name}-{layout}" + "".join(f"-{v}" for v in extra.values())


@pytest.mark.parametrize("name, layout, extra", EXPANDED_RUNS, ids=[_run_id(r) for r in EXPANDED_RUNS])
def test_long_chunks_read_cached_latents_expanded_and_match_transformers(checkpoint, hf_reference, monkeypatch,
                                                                        name, layout, extra):
    got, taken = _expanded_run(checkpoint, monkeypatch, name, layout, 17, **extra)
    assert taken == [1] * (2 * CONFIGS[name][0].num_hidden_layers)  # two steps with one long chunk each, every layer
    want_tokens, steps = hf_reference(checkpoint(name), _expanded_prompts(), NEW_TOKENS, logprobs=True)
    want_logprobs = [[{i: float(row[i]) for i in range(row.shape[0])} for row in rows] for rows in steps]
    assert_same_generation(got.tokens, got.logprobs, want_tokens, want_logprobs, atol=1e-3, same_candidates=False)


def test_expanded_form_reads_an_fp8_cache_as_the_absorbed_one_does(checkpoint, monkeypatch):
    """Both forms read the same e4m3 latents (dequantized with the cache's scale): the same tokens and log-probabilities
    up to float rounding; above the bound, no chunk takes the expanded form."""
    layout = Layout(4, 2, 1, "replicated")
    expanded, taken = _expanded_run(checkpoint, monkeypatch, "v3-moe", layout, 17, kv_cache_dtype="fp8")
    absorbed, none = _expanded_run(checkpoint, monkeypatch, "v3-moe", layout, 1 << 20, kv_cache_dtype="fp8")
    assert taken and not none
    assert_same_generation(expanded.tokens, expanded.logprobs, absorbed.tokens, absorbed.logprobs, atol=1e-3)


@pytest.mark.parametrize("layout", [Layout(1, 1), Layout(4, 2, BLOCK_SIZE, "head-split")], ids=str)
def test_expanded_context_in_pieces_of_one_block_matches_transformers(checkpoint, hf_reference, monkeypatch, layout):
    """A long context expands piece by piece (KVSHARD_MLA_EXPANDED_PIECE_BYTES), the pieces merged by LSE: here one
    block each (head-split: one block of every rank's share, each piece an all-gather of the group)."""
    layout = replace(layout, env=(("KVSHARD_MLA_EXPANDED_PIECE_BYTES", "1"),))
    got, taken = _expanded_run(checkpoint, monkeypatch, "v3-moe", layout, 17)
    assert taken
    want_tokens, steps = hf_reference(checkpoint("v3-moe"), _expanded_prompts(), NEW_TOKENS, logprobs=True)
    want_logprobs = [[{i: float(row[i]) for i in range(row.shape[0])} for row in rows] for rows in steps]
    assert_same_generation(got.tokens, got.logprobs, want_tokens, want_logprobs, atol=1e-3, same_candidates=False)


def test_expanded_form_bound_follows_the_models_dims_and_the_environment(monkeypatch):
    """1.75x the rows at which both forms take the same products: 75 in the demo's dims, 299 in DeepSeek-V3's."""
    from types import SimpleNamespace

    from kvshard.models.deepseek import LatentUpProjection

    def bound(c: int, n: int, v: int) -> int:
        cfg = SimpleNamespace(num_attention_heads=8, qk_nope_head_dim=n, v_head_dim=v, kv_lora_rank=c)
        return LatentUpProjection(cfg, range(8), range(4), torch.float32).expanded_min_rows()

    assert (bound(128, 32, 32), bound(512, 128, 128)) == (75, 299)
    monkeypatch.setenv("KVSHARD_MLA_EXPANDED_MIN_ROWS", "17")
    assert bound(512, 128, 128) == 17
    monkeypatch.setenv("KVSHARD_MLA_EXPANDED_MIN_ROWS", "0")
    with pytest.raises(ConfigError, match="KVSHARD_MLA_EXPANDED_MIN_ROWS='0' is not an integer >= 1"):
        bound(512, 128, 128)


def test_startup_report_says_how_mla_reads_its_cached_context(monkeypatch):
    from kvshard.config.report import startup_report

    report = startup_report(EngineArgs("kvshard-demo").create_engine_config())
    assert "MLA cached context: absorbed for decodes and chunks under 75 rows, expanded" in report
    monkeypatch.setenv("KVSHARD_MLA_EXPANDED_MIN_ROWS", "200")
    assert "chunks under 200 rows" in startup_report(EngineArgs("kvshard-demo").create_engine_config())
    invariant = startup_report(EngineArgs("kvshard-demo", batch_invariant=True).create_engine_config())
    assert "MLA cached context: absorbed for every row (the batch-invariant mode)" in invariant
    assert "MLA cached context" not in startup_report(EngineArgs("kvshard-demo-gqa").create_engine_config())
