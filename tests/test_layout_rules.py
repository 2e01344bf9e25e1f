"""The layout rules have one home (kvshard/config/layout_rules.py): the engine's config and the planner
accept the same (tp, dcp, layout) combinations and give them the same costs, over a grid of models.
In-process, no model files, no ranks."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvshard.config import (
    HEAD_SPLIT, REPLICATED, CacheConfig, ConfigError, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    attention_refusal, choose_attention_layout, head_split_refusal,
)
from kvshard.config import layout_rules as rules
from kvshard.planner.layout import AttentionLayout, attention_shape, layouts_for, refusal
from kvshard.planner.presets import load_model

ROOT = Path(__file__).resolve().parent.parent
MLP = 2**6 * 3**2 * 5 * 7  # splits over every tp of the grid: only attention decides
TPS = range(1, 17)
HEADS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 32)
VALUE_DIMS = (8, 3)  # 3: some head counts' output features do not split over tp


def _models():
    """(heads, kv heads, value dim, MLA?) over the grid: GQA with every KV count dividing the heads, and MLA."""
    for heads, dim in itertools.product(HEADS, VALUE_DIMS):
        for kv in (k for k in range(1, heads + 1) if heads % k == 0):
            yield heads, kv, dim, False
        yield heads, 1, dim, True


def engine_model(heads: int, kv: int, dim: int, mla: bool) -> ModelConfig:
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv, head_dim=dim, hidden_size=64,
                          intermediate_size=MLP, num_hidden_layers=2, kv_lora_rank=dim, qk_rope_head_dim=2,
                          qk_nope_head_dim=4, v_head_dim=dim, q_lora_rank=None, n_routed_experts=None)
    return ModelConfig(Path("grid"), "DeepseekV3ForCausalLM" if mla else "LlamaForCausalLM", cfg, torch.float32,
                       4096, mla)


PLANNER_BASE = {False: load_model("llama-3.1-70b"), True: load_model("deepseek-v3")}


def planner_arch(heads: int, kv: int, dim: int, mla: bool):
    if mla:
        return dataclasses.replace(PLANNER_BASE[True], num_heads=heads, num_kv_heads=1, kv_lora_rank=dim)
    return dataclasses.replace(PLANNER_BASE[False], num_heads=heads, num_kv_heads=kv, head_dim=dim)


def engine_accepts(model: ModelConfig, tp: int, dcp: int, kind: str) -> bool:
    """The engine's refusals, as choose_attention_layout applies them (it also builds a hint of what works,
    too slow to run for each refused case of the grid)."""
    if attention_refusal(model, tp, dcp) is not None or (kind == HEAD_SPLIT and head_split_refusal(model, tp, dcp)):
        return False
    chosen = choose_attention_layout(model, tp, dcp, kind)  # and it runs what was asked for
    assert chosen == kind or dcp == 1  # at dcp = 1 the two layouts are one, reported as head-split
    return True


def head_split_groups_hold_one_kv_head(heads: int, kv: int, tp: int, dcp: int) -> bool:
    """From first principles: rank r computes query heads [r h/T, (r+1) h/T); a DCP group's ranks must all
    need the same single KV head for head-split to share one KV shard without another gather."""
    per_rank, per_kv = heads // tp, heads // kv
    for group in range(tp // dcp):
        ranks = range(group * dcp, (group + 1) * dcp)
        if len({q // per_kv for r in ranks for q in range(r * per_rank, (r + 1) * per_rank)}) != 1:
            return False
    return True


def group_kv_heads(heads: int, kv: int, mla: bool, tp: int, dcp: int) -> list[set[int]]:
    """From first principles: the KV heads (MLA: the one latent) each DCP group's query heads read."""
    groups, per_kv = tp // dcp, heads // kv
    per_group = heads // groups
    return [{0} if mla else {q // per_kv for q in range(g * per_group, (g + 1) * per_group)} for g in range(groups)]


def test_the_engine_and_the_planner_accept_the_same_layouts_at_the_same_costs():
    compared = accepted = refused = 0
    for (heads, kv, dim, mla), tp in itertools.product(_models(), TPS):
        model, arch = engine_model(heads, kv, dim, mla), planner_arch(heads, kv, dim, mla)
        assert attention_shape(arch) == model.attention_shape
        for dcp in [d for d in range(1, tp + 1) if tp % d == 0] + ([tp + 1] if tp > 1 else []):
            planner = {layout.kind: refusal(arch, layout) is None
                       for layout in (layouts_for(tp, dcp) if tp % dcp == 0 else [AttentionLayout(tp, dcp, HEAD_SPLIT)])}
            for kind, planner_ok in planner.items():
                case = f"heads={heads} kv={kv} dim={dim} mla={mla} tp={tp} dcp={dcp} {kind}"
                engine_ok = engine_accepts(model, tp, dcp, kind)
                assert engine_ok == planner_ok, case
                compared += 1
                accepted += engine_ok
                refused += not engine_ok
                if kind == HEAD_SPLIT and dcp > 1 and engine_ok and not mla:
                    assert head_split_groups_hold_one_kv_head(heads, kv, tp, dcp), case
                if not engine_ok:
                    continue
                layout = AttentionLayout(tp, dcp, kind)
                config = EngineConfig(model, ParallelConfig(tp, dcp, 1, kind), CacheConfig(16, 1 << 20, 64, False),
                                      SchedulerConfig(4, 512, 256), seed=0)
                assert config.parallel.attention_tp_size == config.parallel.num_dcp_groups == layout.attention_tp
                assert len(config.parallel.dcp_groups()) == layout.attention_tp, case
                assert config.kv_heads_per_rank == layout.kv_heads_per_rank(arch), case
                assert config.query_heads_per_rank == layout.query_heads_per_rank(arch), case
                # and what they say is so: a group stores the KV heads its queries read, once per token
                held = group_kv_heads(heads, kv, mla, tp, dcp)
                assert config.kv_heads_per_rank == len(held[0]), case
                copies = {sum(k in group for group in held) for k in set().union(*held)}
                assert copies == {config.kv_copies_per_token}, case
                assert config.query_heads_per_rank == heads // (tp // dcp if kind == REPLICATED and dcp > 1 else tp)
    # the grid reaches both answers often, and every rule refuses somewhere
    assert compared > 5000 and accepted > 1000 and refused > 1000, (compared, accepted, refused)


@pytest.mark.parametrize("rule, shape, tp, dcp, kind", [
    ("dcp-divides-tp", rules.AttentionShape(8, 8, 8), 4, 3, REPLICATED),
    ("heads", rules.AttentionShape(9, 3, 8), 4, 1, HEAD_SPLIT),
    ("kv-heads", rules.AttentionShape(24, 12, 8), 16, 2, REPLICATED),
    ("features", rules.AttentionShape(3, 3, 3), 16, 16, REPLICATED),
    ("head-split-heads", rules.AttentionShape(9, 3, 8), 6, 2, HEAD_SPLIT),
    ("head-split-kv", rules.AttentionShape(8, 8, 8), 8, 2, HEAD_SPLIT),
])
def test_every_rule_refuses_somewhere_and_says_so_in_both_wordings(rule, shape, tp, dcp, kind):
    reason = rules.layout_refusal(shape, tp, dcp, kind)
    assert reason is not None and reason.rule == rule
    assert reason.engine_message() != reason.planner_message()  # each in its own terms
    assert kind not in rules.valid_layouts(shape, tp, dcp)


def test_a_refused_layout_is_a_config_error_saying_what_works():
    model = engine_model(9, 3, 8, False)
    with pytest.raises(ConfigError, match="does not divide the model's 9 query heads: at tensor_parallel_size=4 use"):
        choose_attention_layout(model, 4, 1, HEAD_SPLIT)
    with pytest.raises(ConfigError, match="head-split needs tensor_parallel_size=6 .*: use --dcp-attention-layout"):
        choose_attention_layout(model, 6, 2, HEAD_SPLIT)
    assert choose_attention_layout(model, 6, 2, REPLICATED) == REPLICATED


def test_the_rules_module_needs_neither_torch_nor_the_engine():
    probe = ("import sys, types; package = types.ModuleType('kvshard'); "
             f"package.__path__ = [{str(ROOT / 'kvshard')!r}]; sys.modules['kvshard'] = package; "
             "import kvshard.config.layout_rules; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
             "or m.startswith('kvshard.') and m not in ('kvshard.config', 'kvshard.config.layout_rules')))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
