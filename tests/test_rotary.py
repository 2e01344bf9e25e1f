"""apply_rotary against the textbook rotation, bit for bit: x * cos + rotate_half(x) * sin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvshard.layers.rotary import RotaryEmbedding, apply_rotary


def textbook(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """transformers' form: the angles repeated over both halves, the rotated copy built."""
    if interleaved:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1)
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_is_the_textbook_one_bit_for_bit(dtype, interleaved):
    torch.manual_seed(0)
    cos, sin = RotaryEmbedding(SimpleNamespace(rope_theta=10000.0), 64).cos_sin(torch.randint(0, 30000, (37,)))
    assert cos.shape == sin.shape == (37, 32)  # one angle per pair of channels
    fused = torch.randn(37, 15, 64).to(dtype)
    for x in (fused[:, 3:12], fused.contiguous()):  # a strided slice, as q out of the fused QKV projection
        assert torch.equal(apply_rotary(x, cos, sin, interleaved), textbook(x, cos, sin, interleaved))
