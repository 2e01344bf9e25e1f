"""--dcp-comm-backend: the setting reaches every rank and the start-up report, the merge scheme
follows message size, and the per-rank DCP timers reach /metrics.

(Token and logprob equality of a2a and ag_rs: tests/test_dcp_exactness.py and tests/test_mla.py.)
"""

from __future__ import annotations

import re

import pytest

from kvshard import LLM, SamplingParams
from kvshard.attention.backend import A2A, AG_RS, AG_RS_FUSED, merge_scheme
from kvshard.config import ConfigError
from kvshard.engine.arg_utils import EngineArgs
from kvshard.metrics import ServerMetrics
from conftest import environment

KIB = 1024


def test_merge_scheme_follows_backend_and_size():
    fused, a2a_max = 256 * KIB, 16 * KIB * KIB
    assert merge_scheme("a2a", 1 << 40, fused, a2a_max, False) == A2A
    assert merge_scheme("ag_rs", KIB, fused, a2a_max, False) == AG_RS_FUSED
    assert merge_scheme("ag_rs", fused + 1, fused, a2a_max, False) == AG_RS
    assert merge_scheme("ag_rs", fused + 1, fused, a2a_max, True) == AG_RS_FUSED  # a value map needs whole heads
    assert merge_scheme("auto", a2a_max, fused, a2a_max, False) == A2A
    assert merge_scheme("auto", a2a_max + 1, fused, a2a_max, False) == AG_RS


def test_unknown_backend_is_refused_before_any_rank_starts():
    with pytest.raises((ConfigError, ValueError), match="dcp_comm_backend"):
        EngineArgs(model="kvshard-demo", dcp_comm_backend="alltoall").create_engine_config()


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text exposition."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no {name} {labels} in /metrics")


def test_per_rank_dcp_times_and_tokens_reach_metrics():
    with environment({"KVSHARD_DCP_TIMING_EVERY": "1"}), LLM(
            "kvshard-demo", tensor_parallel_size=2, decode_context_parallel_size=2, dcp_comm_backend="a2a",
            block_size=4, max_model_len=128, num_kv_blocks=64, max_num_seqs=4) as llm:
        engine = llm.engine
        assert "--dcp-comm-backend a2a" in llm.config.layout_report()
        engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        steps = 0
        while engine.requests["a"].seqs[0].num_computed_tokens < 37 + 4:  # prefilled, then a few decodes
            engine.step()
            steps += 1
        stats = engine.stats()
        metrics = ServerMetrics(llm.config, "demo")
        metrics.record_stats(stats)
        text = metrics.render().decode()
        layers = llm.config.model.num_layers
    report = stats.dcp_timing
    assert report.steps == steps
    for rank in (0, 1):
        for phase in ("collective", "attention", "merge"):
            seconds = _metric(text, "kvshard:dcp_seconds_total", rank=str(rank), phase=phase)
            assert seconds > 0 and seconds == pytest.approx(report.seconds[rank][phase])
            assert _metric(text, "kvshard:dcp_seconds_per_step", rank=str(rank), phase=phase) == \
                pytest.approx(seconds / steps)
    # every layer of every step that attended to cached context merged once, by all-to-all
    merges = _metric(text, "kvshard:dcp_merges_total", scheme="a2a")
    assert merges > 0 and merges % layers == 0 and merges <= layers * steps
    # the engine's own KV accounting per DCP rank: 41 tokens with interleave 1 -> 21 + 20
    tokens = [_metric(text, "kvshard:dcp_rank_kv_cache_tokens", dcp_rank=str(r)) for r in (0, 1)]
    assert sorted(tokens) == [20, 21] and tokens == stats.kv_tokens_per_dcp_rank
    assert 'dcp_comm_backend="a2a"' in text
