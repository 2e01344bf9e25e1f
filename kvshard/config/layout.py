"""Which attention layout the engine runs a model in: the rules of kvshard/config/layout_rules.py (which the
planner shares) applied to a checkpoint, plus the MLP's own split over all ranks and the `auto` policy."""

from __future__ import annotations

from kvshard import envs
from kvshard.config import layout_rules as rules
from kvshard.config.layout_rules import ATTENTION_LAYOUTS, HEAD_SPLIT, REPLICATED
from kvshard.config.model import ModelConfig
from kvshard.errors import ConfigError


def attention_refusal(model: ModelConfig, tp: int, dcp: int, expert_parallel: bool = False) -> str | None:
    """Why `model` cannot run on tp ranks in DCP groups of dcp in any attention layout, or None (its MLP and
    routed experts split over the tp ranks too: by their count with `expert_parallel`)."""
    reason = rules.attention_refusal(model.attention_shape, tp, dcp)
    if reason is not None and reason.rule == "dcp-divides-tp":
        return reason.engine_message()
    for what, size in model.tp_split_sizes(expert_parallel).items():
        if size % tp:
            hint = ""
            other_splits = all(s % tp == 0 for s in model.tp_split_sizes(not expert_parallel).values())
            if what.startswith("routed experts") and other_splits:
                hint = (" (--enable-expert-parallel splits them by their count, which does)" if not expert_parallel
                        else " with --enable-expert-parallel (without it they split by their width, which does)")
            return f"the model's {what} {size:,} does not split over tensor_parallel_size={tp}{hint}"
    return None if reason is None else reason.engine_message()


def head_split_refusal(model: ModelConfig, tp: int, dcp: int) -> str | None:
    """Why the head-split layout does not apply (given attention_refusal is None), or None."""
    reason = rules.head_split_refusal(model.attention_shape, tp, dcp)
    return None if reason is None else reason.engine_message()


# `auto` replicates a DCP group's queries when that costs a rank at most this many extra bytes of
# query-side weights per layer: below it, reading the weights costs less than the Q all-gather it saves
# (a collective of ~0.1 ms per layer over shared memory on a 2-core CPU; tens of microseconds over
# NCCL, against a fraction of a microsecond to read 1 MiB from HBM). Measured on the GQA demo at tp=2
# dcp=2 (BENCHMARKS.md section 2): 12.5% more time than TP alone with head-split, 0.4% replicated.
AUTO_REPLICATE_MAX_BYTES = envs.env("KVSHARD_AUTO_REPLICATE_MAX_BYTES").default  # 1 MiB


def auto_replicate_max_bytes() -> int:
    """AUTO_REPLICATE_MAX_BYTES, or KVSHARD_AUTO_REPLICATE_MAX_BYTES (0: auto always takes head-split
    where it applies; the test suite uses it to keep its tiny models on the head-split path)."""
    return envs.get("KVSHARD_AUTO_REPLICATE_MAX_BYTES")


def replicated_query_bytes_per_layer(model: ModelConfig, tp: int, dcp: int) -> int:
    """Query-side weight bytes a rank holds per layer in the replicated layout beyond head-split's."""
    a = rules.attention_tp_size(tp, dcp)
    group, own = model.num_heads // a, model.num_heads // tp
    extra = model.head_projection_params(group, 0) - model.head_projection_params(own, 0)
    return extra * model.dtype.itemsize


def choose_attention_layout(model: ModelConfig, tp: int, dcp: int, requested: str = "auto",
                            expert_parallel: bool = False) -> str:
    """The layout asked for; with `auto`, REPLICATED where head-split does not apply or where
    replicating the queries costs at most auto_replicate_max_bytes() per layer, else HEAD_SPLIT.
    ConfigError saying what to change when no layout runs this model at this tp and dcp."""
    if requested not in ATTENTION_LAYOUTS:
        raise ConfigError(f"dcp_attention_layout={requested!r} is not one of {', '.join(ATTENTION_LAYOUTS)}")
    reason = attention_refusal(model, tp, dcp, expert_parallel)
    if reason is not None:
        raise ConfigError(f"{reason}: {_what_works(model, tp, expert_parallel)}")
    head_split = head_split_refusal(model, tp, dcp)
    if requested == HEAD_SPLIT and head_split is not None:
        raise ConfigError(f"{head_split}: use --dcp-attention-layout replicated (or auto)")
    if dcp == 1:
        return HEAD_SPLIT  # the same thing at dcp = 1
    if requested == REPLICATED or head_split is not None:
        return REPLICATED
    if requested == "auto" and replicated_query_bytes_per_layer(model, tp, dcp) <= auto_replicate_max_bytes():
        return REPLICATED
    return HEAD_SPLIT


def _what_works(model: ModelConfig, tp: int, expert_parallel: bool) -> str:
    dcps = [d for d in range(1, tp + 1) if tp % d == 0 and attention_refusal(model, tp, d, expert_parallel) is None]
    if dcps:
        return f"at tensor_parallel_size={tp} use --dcp {' or '.join(map(str, dcps))}"
    tps = [(t, d) for t in range(1, 65) for d in range(1, t + 1)
           if t % d == 0 and attention_refusal(model, t, d, expert_parallel) is None and t > 1]
    examples = ", ".join(f"tp={t} dcp={d}" for t, d in tps[:6])
    return f"no dcp works at tensor_parallel_size={tp}; choose another tp ({examples or 'tp=1'})"

