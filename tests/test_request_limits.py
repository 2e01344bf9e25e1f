"""Range checks of SamplingParams, and the sampler at the extremes of what they let through (no processes)."""

from __future__ import annotations

import pytest
import torch

from kvshard.engine.sampler import _filtered_probs
from kvshard.sampling_params import INT64_MAX, SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", 10**400), ("temperature", -1e-9),
    ("top_p", 0.0), ("top_p", 1.0 + 1e-9), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", INT64_MAX + 1),
    ("seed", INT64_MAX + 1), ("seed", 2**64), ("seed", 1.5),
    ("max_tokens", 0), ("max_tokens", INT64_MAX + 1), ("n", 0), ("n", True),
    ("logprobs", -1), ("logprobs", 21),
    ("stop", [""]), ("stop", ["x"] * 65), ("stop", ["x" * 1025]), ("stop_token_ids", [-1]),
])
def test_out_of_range_value_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError) as refused:
        SamplingParams(**{field: value})
    assert str(refused.value).split()[0] == field


@pytest.mark.parametrize("extreme", [
    dict(top_p=1e-300), dict(top_p=5e-45), dict(temperature=1e-300), dict(temperature=1e300),
    dict(temperature=1e-45, top_p=1e-40, top_k=1), dict(top_k=INT64_MAX),
])
def test_extreme_legal_values_give_a_distribution(extreme):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 10  # [b, V]
    probs = _filtered_probs(logits, [SamplingParams(**extreme)] * 4)
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))
    if extreme.get("top_p", 1) < 1e-10 or extreme.get("temperature", 1) < 1e-10:
        # nothing but the top token is left
        assert (probs.argmax(dim=-1) == logits.argmax(dim=-1)).all() and (probs.max(dim=-1).values == 1).all()
