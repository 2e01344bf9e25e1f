"""Linear layers on CPU multiply by oneDNN's reordered copy of their weight (layers/linear.py)."""

from __future__ import annotations

import pytest
import torch

from kvshard.layers import batch_invariant
from kvshard.layers import linear
from kvshard.layers.linear import (ONEDNN_LINEAR, QKVParallelLinear, ReplicatedLinear, onednn_dtypes,
                                    reorder_linear_weights)

pytestmark = pytest.mark.skipif(ONEDNN_LINEAR is None, reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_reordered_layers_give_torch_linear_and_keep_one_weight(dtype, atol):
    """Where this CPU's oneDNN has no path for `dtype` (bfloat16 on AVX2), the layers keep torch's linear."""
    reordered = dtype in onednn_dtypes()
    torch.manual_seed(0)
    model = torch.nn.Sequential(ReplicatedLinear(64, 96, True, dtype), QKVParallelLinear(96, 16, range(4), range(2),
                                                                                          False, dtype))
    for layer in model:
        torch.nn.init.normal_(layer.weight)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias)
    x = torch.randn(37, 64, dtype=dtype)
    want = model(x)
    assert reorder_linear_weights(model) == (2 if reordered else 0)
    if reordered:
        assert all(layer.weight is None and layer.packed_weight.is_mkldnn for layer in model)
    else:
        assert all(layer.weight is not None and layer.packed_weight is None for layer in model)
    got = model(x)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol * want.abs().max().item(), rtol=0)


def test_bfloat16_keeps_torch_linear_where_onednn_has_no_bfloat16_path(monkeypatch):
    """An AVX2-only CPU: oneDNN's bfloat16 reorder raises there, so a bfloat16 model keeps torch's linear."""
    monkeypatch.setattr(linear, "onednn_dtypes", lambda: (torch.float32,))
    model = torch.nn.Sequential(ReplicatedLinear(8, 8, False, torch.bfloat16), ReplicatedLinear(8, 8, False,
                                                                                                 torch.float32))
    for layer in model:
        torch.nn.init.normal_(layer.weight)
    assert reorder_linear_weights(model) == 1
    assert model[0].weight is not None and model[0].packed_weight is None and model[1].weight is None
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(model[0](x), torch.nn.functional.linear(x, model[0].weight))


def test_onednn_takes_bfloat16_exactly_where_its_reorder_works():
    weight = torch.randn(8, 8, dtype=torch.bfloat16)
    if torch.bfloat16 in onednn_dtypes():
        assert torch.ops.mkldnn._reorder_linear_weight(weight, 32).is_mkldnn
    else:
        with pytest.raises(RuntimeError):
            torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVSHARD_ONEDNN_LINEAR", "0")
    layer = ReplicatedLinear(8, 8, False, torch.float32)
    assert reorder_linear_weights(layer) == 0 and layer.weight is not None


def test_batch_invariant_mode_tiles_the_onednn_product(monkeypatch):
    layer = ReplicatedLinear(64, 96, False, torch.float32)
    torch.nn.init.normal_(layer.weight)
    reorder_linear_weights(layer)
    tiled = []
    row_tiled = batch_invariant.row_tiled
    monkeypatch.setattr(batch_invariant, "row_tiled", lambda product, x, dim: tiled.append(x.shape) or
                        row_tiled(product, x, dim))
    x = torch.randn(45, 64)
    with batch_invariant.batch_invariant_mode():
        together = layer(x)
        alone = layer(x[7:8])
    assert tiled == [(45, 64), (1, 64)]
    assert torch.equal(together[7:8], alone)  # a row's result whatever the rest of the batch


def test_decode_floor_counts_a_reordered_weight_as_its_bytes():
    from kvshard.bench.decode_floor import weight_bytes_per_step

    half = torch.bfloat16 if torch.bfloat16 in onednn_dtypes() else torch.float32  # a second dtype if it has one
    model = torch.nn.Sequential(ReplicatedLinear(64, 96, False, torch.float32), ReplicatedLinear(96, 32, True, half))
    before = weight_bytes_per_step(model, batch_size=8)
    assert reorder_linear_weights(model) == 2
    size = half.itemsize
    assert before == (64 * 96 * 4) + (96 * 32 + 32) * size == weight_bytes_per_step(model, batch_size=8)
