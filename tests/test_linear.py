"""Linear layers on CPU multiply by oneDNN's reordered copy of their weight (layers/linear.py)."""

from __future__ import annotations

import pytest
import torch

from kvshard.layers import batch_invariant
from kvshard.layers import linear
from kvshard.layers.embedding import ParallelLMHead
from kvshard.layers.linear import (ONEDNN_LINEAR, QKVParallelLinear, ReplicatedLinear, cpu_product_dtype,
                                    onednn_dtypes, reorder_linear_weights)
from kvshard.parallel import single_rank_state

pytestmark = pytest.mark.skipif(ONEDNN_LINEAR is None, reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_reordered_layers_give_torch_linear_and_keep_one_weight(dtype, atol):
    """Where this CPU has no arithmetic for `dtype` (bfloat16 on AVX2), the reordered copy is float32's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(ReplicatedLinear(64, 96, True, dtype), QKVParallelLinear(96, 16, range(4), range(2),
                                                                                          False, dtype))
    for layer in model:
        torch.nn.init.normal_(layer.weight)
        if layer.bias is not None:
            torch.nn.init.normal_(layer.bias)
    x = torch.randn(37, 64, dtype=dtype)
    want = model(x)
    assert reorder_linear_weights(model) == 2
    assert all(layer.weight is None and layer.packed_weight.is_mkldnn for layer in model)
    assert all(layer.packed_weight.dtype == cpu_product_dtype(dtype) for layer in model)
    got = model(x)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_in_float32_where_the_cpu_has_no_arithmetic_for_it(monkeypatch, dtype):
    """An AVX2-only CPU: the layer keeps a float32 reordered copy, takes and returns `dtype`, and rounds the
    float32 product once, as a half-precision product does; so does the LM head, keeping its own weight."""
    monkeypatch.setattr(linear, "onednn_dtypes", lambda: (torch.float32,))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False, raising=False)
    assert cpu_product_dtype(dtype) == torch.float32 and cpu_product_dtype(torch.float32) == torch.float32
    torch.manual_seed(0)
    layer = ReplicatedLinear(64, 48, True, dtype)
    head = ParallelLMHead(50, 64, dtype, single_rank_state())
    for param in (layer.weight, layer.bias, head.weight):
        torch.nn.init.normal_(param)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = torch.nn.Sequential(layer, head)
    assert reorder_linear_weights(model) == 1
    assert layer.weight is None and layer.packed_weight.dtype == torch.float32
    assert head.weight.dtype == dtype and head.product_weight.dtype == torch.float32
    x = torch.randn(9, 64, dtype=dtype)
    got = layer(x)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=0)
    logits = head.logits(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x.float(), head.weight.float()).to(dtype).float())
    from kvshard.bench.decode_floor import weight_bytes_per_step

    # a step reads the layer's and the head's float32 copies (not the head's own weight)
    assert weight_bytes_per_step(model, batch_size=4) == (64 * 48 + 50 * 64) * 4 + 48 * dtype.itemsize


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


def test_decode_floor_counts_a_tied_lm_head_as_its_whole_matrix():
    from kvshard.bench.decode_floor import weight_bytes_per_step
    from kvshard.layers.embedding import VocabParallelEmbedding

    def model(tied: bool) -> torch.nn.Module:
        root, state = torch.nn.Module(), single_rank_state()
        root.model = torch.nn.Module()
        root.model.embed_tokens = VocabParallelEmbedding(50, 64, torch.float32, state)
        root.lm_head = ParallelLMHead(50, 64, torch.float32, state)
        if tied:  # as the models tie them: the head's parameter is the embedding's
            root.lm_head.weight = root.model.embed_tokens.weight
        return root

    # the lookup reads a row per request; the head's product reads its whole matrix, also where it is the same one
    assert weight_bytes_per_step(model(tied=False), batch_size=4) == (4 + 50) * 64 * 4
    assert weight_bytes_per_step(model(tied=True), batch_size=4) == 50 * 64 * 4


def test_decode_floor_counts_a_reordered_weight_as_its_bytes():
    from kvshard.bench.decode_floor import weight_bytes_per_step

    model = torch.nn.Sequential(ReplicatedLinear(64, 96, False, torch.float32), ReplicatedLinear(96, 32, True,
                                                                                                 torch.bfloat16))
    before = weight_bytes_per_step(model, batch_size=8)
    assert reorder_linear_weights(model) == 2
    assert before == (64 * 96 * 4) + (96 * 32 + 32) * 2
    # what a step reads: the reordered copy (float32 where the CPU has no bfloat16 arithmetic)
    size = cpu_product_dtype(torch.bfloat16).itemsize
    assert weight_bytes_per_step(model, batch_size=8) == (64 * 96 * 4) + 96 * 32 * size + 32 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_multiplies_by_a_reordered_copy_and_keeps_its_weight(dtype):
    from kvshard.bench.decode_floor import weight_bytes_per_step

    if ONEDNN_LINEAR is None or dtype not in onednn_dtypes():
        pytest.skip(f"oneDNN has no packed product for {dtype} on this CPU")
    torch.manual_seed(0)
    head = ParallelLMHead(50, 64, dtype, single_rank_state())
    torch.nn.init.normal_(head.weight)
    weight = head.weight
    model = torch.nn.Sequential(head)
    reorder_linear_weights(model)
    # the weight stays (a tied embedding reads it); the product reads oneDNN's copy
    assert head.weight is weight and head.packed_weight.is_mkldnn and head.product_weight is None
    x = torch.randn(9, 64, dtype=dtype)
    want = torch.nn.functional.linear(x.float(), weight.float())
    weight.data.zero_()  # the logits come from the copy alone
    got = head.logits(x)
    assert got.dtype == torch.float32 and got.shape == (9, 50)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance * want.abs().max().item(), rtol=0)
    # what a step reads: the copy, not the weight
    assert weight_bytes_per_step(model, batch_size=4) == head.packed_weight.numel() * head.packed_weight.element_size()


def test_products_run_on_few_shapes_whatever_the_token_count(monkeypatch):
    """oneDNN keeps a primitive for every shape it meets (a few hundred KB each): before, an engine meeting every
    token count grew by some 330 MB per 1,000 requests (BENCHMARKS.md section 32). Decode-sized products keep their
    rows; larger ones run on a bucket's rows, zeros padding the rest, and give the unpadded product's rows."""
    weight, bias = torch.randn(96, 64), torch.randn(96)
    packed = linear.onednn_reordered(weight)
    shapes = set()
    original = linear.ONEDNN_LINEAR

    def spy(x, *args):
        shapes.add(tuple(x.shape))
        return original(x, *args)

    monkeypatch.setattr(linear, "ONEDNN_LINEAR", spy)
    for rows in range(1, 2049):
        x = torch.randn(rows, 64)
        got = linear.packed_linear(x, packed, bias)
        assert got.shape == (rows, 96)
        if rows in (1, 64, 65, 100, 2048) or rows % 97 == 0:
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert len(shapes) <= 64 + 62, len(shapes)
    assert {(rows, 64) for rows in range(1, 65)} <= shapes  # a decode step's rows as they are
    x = torch.randn(3, 70, 64)  # leading dimensions flattened, padded, restored
    torch.testing.assert_close(linear.packed_linear(x, packed), torch.nn.functional.linear(x, weight),
                               atol=1e-4, rtol=1e-5)
    # the compiled step's opaque product takes the same buckets
    import kvshard.compilation  # noqa: F401 (registers torch.ops.kvshard.onednn_linear)

    shapes.clear()
    x = torch.randn(70, 64)
    torch.testing.assert_close(torch.ops.kvshard.onednn_linear(x, packed, bias),
                               torch.nn.functional.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert shapes == {(96, 64)}, shapes
