"""Mixture of experts under tensor parallelism: DeepSeek's top-k router and the routed experts.

Hidden states are replicated over TP, so every rank routes every token the same
way. The routed experts split over the ranks in one of two ways:

- by width (the default, as vLLM's): every rank holds every expert's rows
  [r*I/T, (r+1)*I/T) of its intermediate dimension and runs every token, so each
  rank does 1/T of every token's expert work, whichever experts it picks;
- by count (`--enable-expert-parallel`): rank r holds experts [r*E_l, (r+1)*E_l),
  each whole, and runs only the tokens sent to them. A step then waits for the
  rank whose experts got the most tokens; with group-limited routing whose groups
  fall one to a rank (DeepSeek-V3's n_group = T), a token's experts are all on
  one rank (BENCHMARKS.md section 30: the demo's prompt chunks put 1.18x half the
  work on the busier rank). The width split pays for its balance by gathering
  every token's pairs on every rank: on the demo the two ran level.

Either way a rank's output is a partial sum: the MoE block adds the shared
experts' partial (split by intermediate dim) and all-reduces once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvshard.layers import fused
from kvshard.layers.activation import silu_and_mul
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.layers.linear import copy_whole
from kvshard.parallel import ParallelState

ROUTING_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")
_NO_BIAS = torch.empty(0)  # moe_select's bias for the methods without one (not made again each layer and step)
# Multiply-adds of the grouped path's padded products (experts x rows x 3 I D) up to which `auto` takes it.
# The MLA demo's experts: grouped is faster up to a few hundred tokens (70M), slower from ~1,000 (220M), where
# the experts' own products outweigh the loop's dispatch (scripts/bench_moe.py; BENCHMARKS.md section 18).
GROUPED_MAX_MACS = 1 << 27
MOE_PATHS = ("auto", "loop", "grouped", "fused")


@dataclass(frozen=True)
class Routing:
    """How a token picks its experts (the names are those of DeepSeek's configs)."""

    top_k: int
    # "noaux_tc" (V3): sigmoid scores, the choice steered by e_score_correction_bias, groups ranked
    # by the sum of their two best experts. "greedy" / "group_limited_greedy" (V2): softmax scores,
    # groups ranked by their best expert.
    method: str
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        if self.method not in ROUTING_METHODS:
            raise ValueError(f"MoE routing {self.method!r} is not supported; supported: {', '.join(ROUTING_METHODS)}")


class TopKRouter(nn.Module):
    """The gate: `weight` [E, D] and scores in float32, as the reference keeps them."""

    def __init__(self, hidden_size: int, num_experts: int, routing: Routing) -> None:
        super().__init__()
        if num_experts % routing.num_groups:
            raise ValueError(f"{num_experts} experts do not split into n_group={routing.num_groups} groups")
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = copy_whole
        if routing.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = copy_whole

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[t, D] -> (weights [t, k] float32, expert ids [t, k])."""
        routing = self.routing
        logits = nn.functional.linear(x.float(), self.weight)  # [t, E]
        ops = fused.ops_for(logits)
        if ops is not None:  # the choice between the scores and the normalisation in one C++ call (the chain below:
            # its oracle, and the path inside a compiled graph and off a CPU)
            scores = logits.sigmoid() if routing.method == "noaux_tc" else logits.softmax(dim=-1)
            bias = self.e_score_correction_bias if routing.method == "noaux_tc" else _NO_BIAS
            weights, ids = ops.moe_select(scores.contiguous(), bias, ROUTING_METHODS.index(routing.method),
                                          routing.num_groups, routing.topk_groups, routing.top_k)
        else:
            weights, ids = self._choose(logits)
        if routing.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * routing.routed_scaling_factor, ids

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts and their (unnormalised) weights from the logits, in PyTorch's operators."""
        routing = self.routing
        if routing.method == "noaux_tc":
            scores = logits.sigmoid()
            # the bias balances the load: it decides which experts, never how much they weigh
            choice = scores + self.e_score_correction_bias
            choice = self._keep_best_groups(choice, lambda g: g.topk(2, dim=-1).values.sum(-1), float("-inf"))
            ids = choice.topk(routing.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
        else:
            scores = logits.softmax(dim=-1)
            if routing.method == "group_limited_greedy":
                scores = self._keep_best_groups(scores, lambda g: g.amax(dim=-1), 0.0)
            weights, ids = scores.topk(routing.top_k, dim=-1)
        return weights, ids

    def _keep_best_groups(self, scores: torch.Tensor, group_score, fill: float) -> torch.Tensor:
        """Only experts of the `topk_groups` best groups stay candidates; the others get `fill`."""
        routing = self.routing
        grouped = scores.unflatten(-1, (routing.num_groups, -1))  # [t, G, E/G]
        best = group_score(grouped).topk(routing.topk_groups, dim=-1).indices  # [t, topk_groups]
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)


def _slice(loaded: torch.Tensor, dim: int, full: int, start: int, length: int) -> torch.Tensor:
    """This rank's `length` rows (dim 0) or columns (dim 1) from `start` of an expert's checkpoint projection
    whose intermediate dimension `dim` is `full` long; a ValueError naming the shape for any other tensor."""
    if loaded.dim() != 2 or loaded.shape[dim] != full:
        raise ValueError(f"checkpoint expert tensor of shape {tuple(loaded.shape)} does not have the experts' "
                         f"intermediate size {full} along dim {dim}")
    return loaded.narrow(dim, start, length)


class FusedMoE(nn.Module):
    """The routed experts of one layer, split over the TP ranks; forward returns this rank's partial sum.

    Parameters hold this rank's experts stacked: w13_weight [E_l, 2*I_l, D] (gate rows, then up rows)
    and w2_weight [E_l, D, I_l]: every expert's 1/T of the width (E_l = E, I_l = I/T), or with expert
    parallelism E/T whole experts (E_l = E/T, I_l = I). The loader takes checkpoint tensors one expert
    at a time and cuts this rank's part.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype, parallel: ParallelState
    ) -> None:
        super().__init__()
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.expert_parallel = expert_parallel = parallel.expert_parallel
        if expert_parallel:
            if num_experts % tp:
                raise ValueError(
                    f"the model's {num_experts} routed experts do not divide over tensor_parallel_size={tp} "
                    "ranks with --enable-expert-parallel: choose a tp that divides the expert count, or leave "
                    "expert parallelism off (each expert split over the ranks)"
                )
            self.num_local_experts, self.first_expert = num_experts // tp, rank * (num_experts // tp)
            self.intermediate_size, self.first_row = intermediate_size, 0
        else:
            if intermediate_size % tp:
                raise ValueError(
                    f"the routed experts' intermediate size {intermediate_size} does not divide over "
                    f"tensor_parallel_size={tp}: choose a tp that divides it, or --enable-expert-parallel "
                    "(whole experts on each rank)"
                )
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate_size = intermediate_size // tp
            self.first_row = rank * self.intermediate_size  # this rank's rows of each expert's intermediate
        self.full_intermediate_size = intermediate_size
        e_l, i, d = self.num_local_experts, self.intermediate_size, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e_l, 2 * i, d, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e_l, d, i, dtype=dtype), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        """shard_id = (expert, 0 for gate_proj / 1 for up_proj / None for down_proj). Expert parallel: other
        ranks' experts are skipped; otherwise this rank's rows of the intermediate dimension are cut out."""
        expert, part = shard_id
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        target, i = param.data[local], self.intermediate_size
        if part is not None:  # gate_proj / up_proj [I, D]: rows
            target = target.narrow(0, part * i, i)
            if not self.expert_parallel:
                loaded = _slice(loaded, 0, self.full_intermediate_size, self.first_row, i)
        elif not self.expert_parallel:  # down_proj [D, I]: columns
            loaded = _slice(loaded, 1, self.full_intermediate_size, self.first_row, i)
        copy_whole(target, loaded)

    def opaque_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.forward(x, topk_weights, topk_ids)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                path: str = "auto") -> torch.Tensor:
        """x [t, D], topk_weights / topk_ids [t, k] -> [t, D], the sum over this rank's experts only
        (outside a compiled graph: its experts are picked on the host; kvshard/compilation.py).

        Three paths give the same sums: `loop`, one pair of products per expert that has tokens;
        `grouped`, every expert's tokens at once in two batched products over a [E_l, m, D] buffer
        (m: the most tokens any one expert got, the others' rows zero); and `fused`, the loop's
        products on the same rows in one C++ call of the kernel extension (`moe_experts`: the pairs
        sorted by expert, each expert's rows gathered once, the experts spread over the threads).
        A decode step's few tokens make the loop a dozen small operators per expert, whose dispatch
        outweighs the arithmetic. `auto` takes `fused` where the extension's fused operators run (a
        CPU with AVX-512, float32 or bfloat16: `fused.ops_for`); elsewhere `grouped` where more than
        two experts have tokens and the padded products stay under GROUPED_MAX_MACS, and `loop`
        otherwise; under batch_invariant_mode (where no choice may depend on the batch) `loop`."""
        if path not in MOE_PATHS:
            raise ValueError(f"MoE path {path!r}: one of {', '.join(MOE_PATHS)}")
        if path == "fused" or (path == "auto" and not batch_invariant_active()):
            out = self._fused(x, topk_weights, topk_ids, always=path == "fused")
            if out is not None:
                return out
        local_ids = topk_ids - self.first_expert  # [t, k]
        mine = (local_ids >= 0) & (local_ids < self.num_local_experts)
        if path == "grouped" or (path == "auto" and not batch_invariant_active()):
            grouped = self._grouped(x, topk_weights, local_ids, mine, always=path == "grouped")
            if grouped is not None:
                return grouped
        return self._loop(x, topk_weights, local_ids, mine)

    def _fused(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               always: bool) -> torch.Tensor | None:
        ops = fused.ops_for(x, avx512=True)  # where the extension's SiLU-and-multiply is the layers' own
        if ops is None or topk_weights.dtype != torch.float32:
            if always:
                raise ValueError("the fused MoE path needs the kernel extension's fused operators (a CPU with "
                                 "AVX-512, float32 or bfloat16, KVSHARD_FUSED_ELEMENTWISE on) and float32 weights")
            return None
        return ops.moe_experts(x, topk_weights, topk_ids - self.first_expert, self.w13_weight, self.w2_weight)

    def _grouped(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor, mine: torch.Tensor,
                 always: bool) -> torch.Tensor | None:
        e_l, (t, k), d = self.num_local_experts, local_ids.shape, x.shape[-1]
        if t * k <= 2 and not always:  # two experts at most: not worth counting
            return None
        bucket = torch.where(mine, local_ids, e_l).flatten()  # [t*k]: other ranks' experts in bucket e_l
        counts = torch.bincount(bucket, minlength=e_l + 1)  # [e_l + 1]
        per_expert = counts[:e_l].tolist()
        rows = max(per_expert)
        # two experts or fewer (a lone token): the loop's few operators cost less than the buffer's
        small = sum(1 for n in per_expert if n) <= 2 or e_l * rows * 3 * self.intermediate_size * d > GROUPED_MAX_MACS
        if small and not always:
            return None
        out = torch.zeros_like(x)
        if rows == 0:
            return out
        order = bucket.argsort(stable=True)  # (token, slot) pairs by expert, tokens ascending within one
        expert = bucket[order]
        starts = counts.cumsum(0) - counts
        kept = expert < e_l
        order, expert = order[kept], expert[kept]
        row = torch.arange(order.shape[0], device=x.device) - starts[expert]  # a pair's row within its expert's group
        token, slot = order // k, order % k
        buffer = x.new_zeros(e_l, rows, d)
        buffer[expert, row] = x[token]
        h = silu_and_mul(torch.bmm(buffer, self.w13_weight.transpose(1, 2)))  # [e_l, rows, I]
        y = torch.bmm(h, self.w2_weight.transpose(1, 2))[expert, row]  # [pairs, D]
        # pairs in expert order: a token's experts add up in the loop's order
        return out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(out.dtype))

    def _loop(self, x: torch.Tensor, topk_weights: torch.Tensor, local_ids: torch.Tensor,
              mine: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in local_ids[mine].unique().tolist():
            token, slot = (local_ids == expert).nonzero(as_tuple=True)  # [m], [m]
            h = silu_and_mul(nn.functional.linear(x[token], self.w13_weight[expert]))  # [m, I]
            y = nn.functional.linear(h, self.w2_weight[expert]) * topk_weights[token, slot, None]  # [m, D] float32
            out.index_add_(0, token, y.to(out.dtype))
        return out
