"""The routed experts (kvshard/layers/moe.py): split over the ranks by width (the default) or by count (expert
parallel), each rank's share loaded from whole checkpoint tensors adds up over the ranks to the unsplit layer; the
per-expert loop, the grouped batched products and the kernel extension's fused call give a rank's partial sum as a
float64 computation of the definition does, and `auto` picks between them."""

from __future__ import annotations

import pytest
import torch

from kvshard.layers import fused
from kvshard.layers import moe as moe_module
from kvshard.layers.batch_invariant import batch_invariant_mode
from kvshard.layers.moe import FusedMoE
from kvshard.parallel import ParallelState

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 2


def _paths(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """The paths this machine runs: `fused` where the kernel extension's fused operators do (AVX-512)."""
    here = fused.ops_for(torch.zeros(1, dtype=dtype), avx512=True) is not None
    return ("loop", "grouped", "auto") + (("fused",) if here else ())


def _experts(tp: int, rank: int, dtype: torch.dtype, expert_parallel: bool = True) -> FusedMoE:
    parallel = ParallelState(rank=rank, world_size=tp, dcp_rank=0, dcp_size=1, dcp_group_index=0,
                             expert_parallel=expert_parallel)
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, dtype, parallel)
    generator = torch.Generator().manual_seed(rank)
    for weight in (layer.w13_weight, layer.w2_weight):
        weight.data.copy_(torch.randn(weight.shape, generator=generator) * 0.2)
    return layer


def _routing(tokens: int, seed: int, experts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    choices = experts or list(range(EXPERTS))
    ids = torch.stack([torch.tensor(choices)[torch.randperm(len(choices), generator=generator)[:TOP_K]]
                       for _ in range(tokens)]) if tokens else torch.zeros(0, TOP_K, dtype=torch.long)
    return torch.rand(tokens, TOP_K, generator=generator), ids


def _definition(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum over a token's experts held by this rank of weight * down(silu(gate x) * up x), in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = layer.w13_weight.double(), layer.w2_weight.double()
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            local = int(ids[token, slot]) - layer.first_expert
            if not 0 <= local < layer.num_local_experts:
                continue
            gate, up = (w13[local] @ x[token].double()).chunk(2)
            out[token] += weights[token, slot].double() * (w2[local] @ (torch.nn.functional.silu(gate) * up))
    return out


# tolerances relative to the largest output
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tp, rank", [(1, 0), (2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("tokens", [0, 1, 3, 16, 70])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_loop_and_grouped_give_the_definition(dtype, tolerance, tp, rank, tokens, expert_parallel):
    layer = _experts(tp, rank, dtype, expert_parallel)
    weights, ids = _routing(tokens, seed=tokens + 10 * tp + rank)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    want = _definition(layer, x, weights, ids)
    atol = tolerance * max(1.0, want.abs().max().item() if tokens else 0.0)
    results = {path: layer(x, weights, ids, path=path) for path in _paths(dtype)}
    for path, got in results.items():
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, msg=f"{path} path")
    torch.testing.assert_close(results["grouped"], results["loop"], atol=atol / 10, rtol=0)
    if "fused" in results:  # the loop's products on the same rows (the library's blocking may differ by thread)
        torch.testing.assert_close(results["fused"], results["loop"], atol=atol / 10, rtol=0)


def _checkpoint(seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A layer's experts as a checkpoint stores them: expert -> (gate_proj [I, D], up_proj [I, D], down_proj [D, I])."""
    generator = torch.Generator().manual_seed(seed)
    return {e: tuple(torch.randn(shape, generator=generator) * 0.2
                     for shape in ((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)))
            for e in range(EXPERTS)}


def _loaded(tp: int, rank: int, expert_parallel: bool, checkpoint) -> FusedMoE:
    parallel = ParallelState(rank=rank, world_size=tp, dcp_rank=0, dcp_size=1, dcp_group_index=0,
                             expert_parallel=expert_parallel)
    layer = FusedMoE(EXPERTS, HIDDEN, INTERMEDIATE, torch.float32, parallel)
    for expert, (gate, up, down) in checkpoint.items():
        layer.weight_loader(layer.w13_weight, gate, (expert, 0))
        layer.weight_loader(layer.w13_weight, up, (expert, 1))
        layer.weight_loader(layer.w2_weight, down, (expert, None))
    return layer


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_the_ranks_partial_sums_add_up_to_the_unsplit_layer(tp, expert_parallel):
    """Each rank's share of whole checkpoint tensors (its experts, or its rows of every expert's width), run on
    every token, sums over the ranks to the layer on one rank: the all-reduce's input is right in both splits."""
    checkpoint = _checkpoint(seed=7)
    whole = _loaded(1, 0, expert_parallel, checkpoint)
    tokens = 40
    weights, ids = _routing(tokens, seed=11)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(12))
    want = _definition(whole, x, weights, ids)
    ranks = [_loaded(tp, rank, expert_parallel, checkpoint) for rank in range(tp)]
    if expert_parallel:
        assert [r.w13_weight.shape for r in ranks] == [(EXPERTS // tp, 2 * INTERMEDIATE, HIDDEN)] * tp
    else:
        assert [r.w13_weight.shape for r in ranks] == [(EXPERTS, 2 * INTERMEDIATE // tp, HIDDEN)] * tp
        assert [r.w2_weight.shape for r in ranks] == [(EXPERTS, HIDDEN, INTERMEDIATE // tp)] * tp
    for path in _paths():
        got = sum(r(x, weights, ids, path=path).double() for r in ranks)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0, msg=path)
    if not expert_parallel:  # split by width, every rank runs every token: a rank's share is no rank's whole
        assert all(r(x, weights, ids).abs().max() > 0 for r in ranks)


def test_a_checkpoint_expert_of_another_width_is_refused():
    checkpoint = _checkpoint(seed=1)
    layer = _loaded(2, 1, False, checkpoint)
    with pytest.raises(ValueError, match=r"shape \(16, 64\) does not have the experts' intermediate size 32"):
        layer.weight_loader(layer.w13_weight, torch.zeros(INTERMEDIATE // 2, HIDDEN), (0, 0))


@pytest.mark.parametrize("expert_parallel, message", [
    (True, "routed experts do not divide over tensor_parallel_size=3 ranks with --enable-expert-parallel"),
    (False, "intermediate size 32 does not divide over tensor_parallel_size=3"),
])
def test_a_split_that_does_not_divide_is_refused(expert_parallel, message):
    with pytest.raises(ValueError, match=message):
        _experts(3, 0, torch.float32, expert_parallel)


def test_every_token_on_one_expert_and_none_on_this_rank():
    layer = _experts(2, 1, torch.float32)  # experts 4..7
    x = torch.randn(9, HIDDEN)
    weights, ids = _routing(9, seed=3, experts=[5, 1])  # every token: expert 5 (here) and 1 (elsewhere)
    for path in _paths():
        torch.testing.assert_close(layer(x, weights, ids, path=path).double(), _definition(layer, x, weights, ids),
                                   atol=1e-5, rtol=0)
    weights, ids = _routing(9, seed=4, experts=[0, 1, 2, 3])  # none here: zeros
    for path in _paths():
        assert torch.equal(layer(x, weights, ids, path=path), torch.zeros_like(x))


def _paths_taken(monkeypatch, layer: FusedMoE, x, weights, ids) -> list[str]:
    taken: list[str] = []
    for name in ("_loop", "_grouped", "_fused"):
        original = getattr(layer, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            result = _original(*args, **kwargs)
            if result is not None:
                taken.append(_name.lstrip("_"))
            return result

        monkeypatch.setattr(layer, name, spy)
    layer(x, weights, ids)
    return taken


def test_auto_takes_the_fused_call_wherever_the_extension_runs(monkeypatch):
    if "fused" not in _paths():
        pytest.skip("the kernel extension's fused operators do not run here (no AVX-512 or no compiler)")
    layer = _experts(1, 0, torch.float32)
    for tokens in (1, 3, 16, 200):
        weights, ids = _routing(tokens, seed=tokens)
        assert _paths_taken(monkeypatch, layer, torch.randn(tokens, HIDDEN), weights, ids) == ["fused"], tokens
    with batch_invariant_mode():  # no choice that depends on the batch
        assert _paths_taken(monkeypatch, layer, torch.randn(16, HIDDEN), weights[:16], ids[:16]) == ["loop"]


def test_the_fused_path_asked_for_where_it_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(fused, "ops_for", lambda *args, **kwargs: None)
    layer = _experts(1, 0, torch.float32)
    weights, ids = _routing(3, seed=3)
    with pytest.raises(ValueError, match="the fused MoE path needs the kernel extension's fused operators"):
        layer(torch.randn(3, HIDDEN), weights, ids, path="fused")


def test_auto_groups_decode_sized_steps_and_loops_otherwise(monkeypatch):
    monkeypatch.setattr(fused, "ops_for", lambda *args, **kwargs: None)  # where the fused call does not run
    layer = _experts(1, 0, torch.float32)
    for tokens, want in ((1, "loop"), (3, "grouped"), (16, "grouped")):
        weights, ids = _routing(tokens, seed=tokens)
        assert _paths_taken(monkeypatch, layer, torch.randn(tokens, HIDDEN), weights, ids) == [want], tokens
    # many tokens, but two experts: the loop's two passes cost less than the buffer
    weights, ids = _routing(5, seed=5, experts=[2, 5])
    assert _paths_taken(monkeypatch, layer, torch.randn(5, HIDDEN), weights, ids) == ["loop"]
    # past GROUPED_MAX_MACS the experts' own products outweigh the loop's dispatch
    monkeypatch.setattr(moe_module, "GROUPED_MAX_MACS", 3 * INTERMEDIATE * HIDDEN * EXPERTS * 2 - 1)
    weights, ids = _routing(16, seed=16)
    assert _paths_taken(monkeypatch, layer, torch.randn(16, HIDDEN), weights, ids) == ["loop"]
    # no choice that depends on the batch under batch_invariant_mode
    monkeypatch.setattr(moe_module, "GROUPED_MAX_MACS", 1 << 40)
    with batch_invariant_mode():
        assert _paths_taken(monkeypatch, layer, torch.randn(16, HIDDEN), weights, ids) == ["loop"]


def test_an_unknown_path_is_refused():
    layer = _experts(1, 0, torch.float32)
    weights, ids = _routing(3, seed=3)
    with pytest.raises(ValueError, match="MoE path 'groupd'"):
        layer(torch.randn(3, HIDDEN), weights, ids, path="groupd")


# (tokens, experts, groups, best groups kept, top_k): DeepSeek-V3's 256 experts in 8 groups keeping 4, top 8; V2's 160
# in 8 keeping 3, top 6; the demo-sized ones; a single group; one token and many
ROUTERS = [(1, 256, 8, 4, 8), (37, 256, 8, 4, 8), (5, 160, 8, 3, 6), (300, 16, 4, 2, 2), (9, 8, 1, 1, 2),
           (64, 64, 8, 8, 6)]


@pytest.mark.parametrize("method", moe_module.ROUTING_METHODS)
@pytest.mark.parametrize("shape", ROUTERS, ids=lambda s: "x".join(map(str, s)))
def test_the_routers_fused_choice_gives_the_eager_chains_experts_and_weights(method, shape, monkeypatch):
    """The router's choice in one C++ call (`moe_select`, where the extension runs) against PyTorch's chain of
    operators (`_choose`, its oracle): the same experts in the same order and the same weights, to the bit."""
    if fused.cpu_ops() is None:
        pytest.skip("the kernel extension's fused operators do not run here (no compiler, or switched off)")
    tokens, experts, groups, kept, top_k = shape
    routing = moe_module.Routing(top_k=top_k, method=method, num_groups=groups, topk_groups=kept,
                                 norm_topk_prob=method == "noaux_tc", routed_scaling_factor=2.5)
    router = moe_module.TopKRouter(32, experts, routing)
    gen = torch.Generator().manual_seed(tokens * experts + len(method))
    router.weight.copy_(torch.randn(experts, 32, generator=gen))
    if method == "noaux_tc":
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    x = torch.randn(tokens, 32, generator=gen).to(torch.bfloat16)
    chosen = []
    original = router._choose
    monkeypatch.setattr(router, "_choose", lambda logits: chosen.append(1) or original(logits))
    fused_weights, fused_ids = router(x)
    assert not chosen  # the fused call made the choice
    with monkeypatch.context() as patch:
        patch.setattr(fused, "ops_for", lambda *args, **kwargs: None)
        weights, ids = router(x)
    assert chosen
    assert torch.equal(fused_ids, ids), (fused_ids, ids)
    assert torch.equal(fused_weights, weights)
    assert fused_weights.dtype == torch.float32 and fused_ids.dtype == torch.int64
