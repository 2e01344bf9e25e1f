"""Linear layers on CPU multiply by oneDNN's reordered copy of their weight, or bfloat16 ones on AMX tiles from the
weight itself (layers/linear.py)."""

from __future__ import annotations

import pytest
import torch

from kvshard.layers import batch_invariant, cpu_dtypes
from kvshard.layers import linear
from kvshard.layers.embedding import ParallelLMHead
from kvshard.layers.linear import (ONEDNN_LINEAR, QKVParallelLinear, ReplicatedLinear, cpu_product_dtype,
                                    onednn_dtypes, reorder_linear_weights)
from kvshard.parallel import single_rank_state

pytestmark = pytest.mark.skipif(ONEDNN_LINEAR is None, reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_reordered_layers_give_torch_linear_and_keep_one_weight(monkeypatch, dtype, atol):
    """Where this CPU has no arithmetic for `dtype` (bfloat16 on AVX2), the reordered copy is float32's."""
    monkeypatch.setenv("KVSHARD_AMX_LINEAR", "0")  # bfloat16 on AMX tiles: below
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
    monkeypatch.setattr(cpu_dtypes, "onednn_dtypes", lambda: (torch.float32,))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False, raising=False)
    monkeypatch.setenv("KVSHARD_AMX_LINEAR", "0")  # nor AMX tiles on such a CPU
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
    half = ReplicatedLinear(64, 32, False, torch.bfloat16)  # a shape the AMX tiles take: torch's linear too
    assert reorder_linear_weights(half) == 0 and half.packed_weight is None and not half.amx_weight


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


def test_decode_floor_counts_a_reordered_weight_as_its_bytes(monkeypatch):
    from kvshard.bench.decode_floor import weight_bytes_per_step

    monkeypatch.setenv("KVSHARD_AMX_LINEAR", "0")
    model = torch.nn.Sequential(ReplicatedLinear(64, 96, False, torch.float32), ReplicatedLinear(96, 32, True,
                                                                                                 torch.bfloat16))
    before = weight_bytes_per_step(model, batch_size=8)
    assert reorder_linear_weights(model) == 2
    assert before == (64 * 96 * 4) + (96 * 32 + 32) * 2
    # what a step reads: the reordered copy (float32 where the CPU has no bfloat16 arithmetic)
    size = cpu_product_dtype(torch.bfloat16).itemsize
    assert weight_bytes_per_step(model, batch_size=8) == (64 * 96 * 4) + 96 * 32 * size + 32 * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lm_head_multiplies_by_a_reordered_copy_and_keeps_its_weight(monkeypatch, dtype):
    from kvshard.bench.decode_floor import weight_bytes_per_step

    monkeypatch.setenv("KVSHARD_AMX_LINEAR", "0")
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


def amx_linear_here() -> bool:
    return linear.amx_linear_weight(torch.empty(16, 32, dtype=torch.bfloat16))


needs_amx = pytest.mark.skipif(not amx_linear_here(), reason="no AMX tiles here (CPU, system or kernel build)")


def rounded_once(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 product of bfloat16 operands (exact products, float32 sums), plus the bias, as float32."""
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


@needs_amx
@pytest.mark.parametrize("rows, features, channels, with_bias", [
    (1, 16, 32, False), (5, 48, 64, True), (16, 32, 96, False), (17, 960, 576, True), (33, 3072, 576, False),
    (64, 576, 1536, True), (100, 80, 128, True), (256, 16, 32, False)])
def test_amx_product_is_the_float32_product_rounded_once(rows, features, channels, with_bias):
    """Every shape the tiles take: one or two 16-feature tiles a block, one or two 16-row tiles, rows past a tile's
    16 (zeros), a bias: within a bfloat16 rounding of the float32 product (the sums run in another order than
    torch's, so the bits differ from it at some ties), and each row's result the same alone as in the batch."""
    torch.manual_seed(rows * features)
    x = torch.randn(rows, channels, dtype=torch.bfloat16)
    weight = torch.randn(features, channels, dtype=torch.bfloat16) / channels ** 0.5
    bias = torch.randn(features, dtype=torch.bfloat16) if with_bias else None
    got = linear.amx_or_torch_product(x, weight, bias)
    want = rounded_once(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, features)
    # at most half a bfloat16 step (up to 2^-8 of the value) from the float32 sum, plus the sums' own float32 rounding
    assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-5).all()
    assert (got == want.bfloat16()).float().mean() > 0.99
    for row in (0, rows - 1):
        assert torch.equal(linear.amx_or_torch_product(x[row:row + 1], weight, bias), got[row:row + 1])


@needs_amx
@pytest.mark.parametrize("rows, intermediate, channels, with_bias", [
    (1, 16, 32, False), (5, 48, 64, True), (17, 1536, 576, False), (33, 80, 96, True), (64, 16, 576, True)])
def test_gate_up_with_silu_in_its_epilogue_gives_the_bits_of_the_two_calls(rows, intermediate, channels, with_bias,
                                                                            fused_ops):
    """`amx_linear_silu` (the decode program's MLP: SiLU-and-multiply in the gate-up product's epilogue) against
    the two calls it replaces, `silu_and_mul(amx_linear(...))`: the same bits, for gates far into both tails of SiLU
    (where it rounds to 0 or to the gate), subnormal products and a bias; one or two 16-row tiles."""
    torch.manual_seed(rows + intermediate)
    x = torch.randn(rows, channels, dtype=torch.bfloat16)
    weight = torch.randn(2 * intermediate, channels, dtype=torch.bfloat16) * (4 / channels ** 0.5)
    weight[intermediate // 2] *= 40  # gates of +-100: SiLU's tails
    weight[-1] *= 1e-38  # an up product in float32's subnormals: silu(g) * up rounds there
    bias = torch.randn(2 * intermediate, dtype=torch.bfloat16) if with_bias else None
    two_calls = fused_ops.silu_and_mul(fused_ops.amx_linear(x, weight, bias))
    one = fused_ops.amx_linear_silu(x, weight, bias)
    assert one.shape == (rows, intermediate) and one.dtype == torch.bfloat16
    assert torch.equal(one.view(torch.int16), two_calls.view(torch.int16))
    assert (fused_ops.amx_linear(x, weight, bias)[:, intermediate // 2].float().abs() > 20).any()  # a tail's gate
    with pytest.raises(RuntimeError, match="I a multiple of 16"):
        fused_ops.amx_linear_silu(x, weight[:2 * intermediate - 16], None)


@needs_amx
@pytest.mark.parametrize("rows, heads, head_size", [(1, 9, 64), (32, 9, 64), (17, 4, 32), (40, 2, 128)])
def test_the_heads_float32_output_is_packed_as_flatten_heads_rounds_it(rows, heads, head_size, fused_ops):
    """`amx_linear` of the paged kernel's float32 output per head, a view that skips each head's LSE column (the
    decode program's output product), against `flatten_heads` to bfloat16 and then the product: the same bits,
    subnormals (which the tiles' products take as zeros either way) and values halfway between two bfloat16 steps
    included."""
    torch.manual_seed(rows * heads)
    packed = torch.randn(rows, heads, head_size + 1) * 3
    packed[0, 0, :4] = torch.tensor([1e-40, -3e-39, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])  # subnormals, ties to even
    out = packed[..., :head_size]
    weight = torch.randn(48, heads * head_size, dtype=torch.bfloat16) / (heads * head_size) ** 0.5
    weight[:2] = 0  # features 0 and 1 read channels 2 and 3 alone: their rounding to even shows
    weight[0, 2] = weight[1, 3] = 1.0
    want = fused_ops.amx_linear(fused_ops.flatten_heads(out, True), weight, None)
    assert want[0, :2].tolist() == [1.0, 1.0 + 2 ** -6]
    assert torch.equal(fused_ops.amx_linear(out, weight, None).view(torch.int16), want.view(torch.int16))
    with pytest.raises(RuntimeError, match="multiple of 32 a head"):
        fused_ops.amx_linear(torch.randn(rows, 2, 50)[..., :48], torch.zeros(16, 96, dtype=torch.bfloat16), None)


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 20, 33, 128])
def test_the_pair_layout_gives_the_bits_of_the_weight_as_it_lies(rows, fused_ops):
    """The products from a weight in the tiles' pair layout (the rows the A tiles, the weight the B tiles) against
    the weight as it lies (the weight the A tiles): the same bits in every form of output (bfloat16, with a bias,
    widened to float32, SiLU-and-multiply in the epilogue), from the heads' float32 output and from strided rows;
    whole and partial 16-row groups, one and two 16-feature tiles a block; and the layout is a permutation."""
    torch.manual_seed(rows)
    for features, channels in ((960, 576), (48, 64), (3072, 576), (576, 1536)):
        weight = torch.randn(features, channels, dtype=torch.bfloat16) / channels ** 0.5
        paired = linear.pair_weight(weight).contiguous()
        assert paired.shape == (features // 16, channels // 32, 16, 32)
        assert paired[1, 1, 3, 9].item() == weight[16 + 4, 32 + 7].item()  # [t][c][p][2n + j]: w[16t + n][32c + 2p + j]
        assert torch.equal(linear.plain_weight(paired), weight)
        x = torch.randn(rows, channels, dtype=torch.bfloat16)
        bias = torch.randn(features, dtype=torch.bfloat16)
        for b in (None, bias):
            for float_out in (False, True):
                assert torch.equal(fused_ops.amx_linear(x, paired, b, float_out).view(torch.int16 if not float_out
                                                                                     else torch.int32),
                                   fused_ops.amx_linear(x, weight, b, float_out).view(torch.int16 if not float_out
                                                                                      else torch.int32))
        if features % 32 == 0:
            assert torch.equal(fused_ops.amx_linear_silu(x, paired, bias), fused_ops.amx_linear_silu(x, weight, bias))
        wide = torch.randn(rows, channels + 64, dtype=torch.bfloat16)[:, 32:32 + channels]
        assert torch.equal(fused_ops.amx_linear(wide, paired, None), fused_ops.amx_linear(wide, weight, None))
    heads = torch.randn(rows, 9, 65)[..., :64]
    weight = torch.randn(576, 576, dtype=torch.bfloat16) / 24
    paired = linear.pair_weight(weight).contiguous()
    assert torch.equal(fused_ops.amx_linear(heads, paired, None), fused_ops.amx_linear(heads, weight, None))
    with pytest.raises(RuntimeError, match="are not w's"):
        fused_ops.amx_linear(torch.randn(rows, 64, dtype=torch.bfloat16), paired, None)


@needs_amx
def test_amx_product_takes_strided_and_batched_rows():
    torch.manual_seed(1)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    wide = torch.randn(3, 7, 200, dtype=torch.bfloat16)
    x = wide[..., 50:146]  # rows 200 elements apart, leading dimensions kept
    got = linear.amx_or_torch_product(x, weight, None)
    assert got.shape == (3, 7, 64)
    assert torch.equal(got, linear.amx_or_torch_product(x.contiguous(), weight, None))
    assert ((got.float() - rounded_once(x, weight)).abs() <= rounded_once(x, weight).abs() * 2.0 ** -8 + 1e-5).all()
    assert linear.amx_or_torch_product(x[:0], weight, None).shape == (0, 7, 64)


@needs_amx
def test_bfloat16_layers_multiply_on_amx_tiles_from_their_weight(monkeypatch):
    """A bfloat16 layer keeps its weight, the same Parameter in the tiles' pair layout (no second copy), and runs
    products of up to 512 rows on the tiles from it, more rows through torch's linear from a plain copy on a bucket's
    rows; in batch-invariant mode torch's linear, tiled by the mode; its shapes the tiles cannot take (K not a
    multiple of 32) keep oneDNN's copy; KVSHARD_AMX_LINEAR=0 keeps it for all. (A weight as it lies, the LM head's,
    takes the tiles up to 128 rows, or 256 while its rows' packed copy stays within 1 MiB.)"""
    torch.manual_seed(2)
    layer, odd = ReplicatedLinear(64, 96, True, torch.bfloat16), ReplicatedLinear(40, 96, False, torch.bfloat16)
    for param in (layer.weight, layer.bias, odd.weight):
        torch.nn.init.normal_(param)
    weight, bias, plain = layer.weight, layer.bias, layer.weight.detach().clone()
    assert reorder_linear_weights(torch.nn.Sequential(layer, odd)) == 2
    assert layer.amx_weight and layer.weight is weight and layer.packed_weight is None
    assert weight.shape == (6, 2, 16, 32) and torch.equal(linear.plain_weight(weight), plain)
    assert layer.weight_shape == (96, 64)
    assert not odd.amx_weight and odd.weight is None and odd.packed_weight.is_mkldnn
    tiles, torch_rows = [], []
    from kvshard.attention import paged

    module = paged.load_extension()
    real_tiles, real_linear = module.amx_linear, torch.nn.functional.linear

    class Spy:
        def __getattr__(self, name):
            return getattr(module, name)

        def amx_linear(self, x, *args):
            tiles.append(x.shape[0])
            return real_tiles(x, *args)

    monkeypatch.setattr(paged, "load_extension", lambda: Spy())
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, *args: torch_rows.append(x.shape[0]) or
                        real_linear(x, *args))
    for rows in (1, 32, 256, 257, 700):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        want = rounded_once(x, plain, bias)
        got = layer(x)
        assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-4).all(), rows
    assert tiles == [1, 32, 256, 257] and torch_rows == [704]  # 700 rows on its bucket's rows
    assert linear.amx_takes(128, 8192) and linear.amx_takes(256, 2048) and not linear.amx_takes(129, 4097)
    assert linear.amx_takes(512, 8192, paired=True) and not linear.amx_takes(513, 64, paired=True)
    tiles.clear()
    torch_rows.clear()
    x = torch.randn(45, 64, dtype=torch.bfloat16)
    with batch_invariant.batch_invariant_mode():
        together, alone = layer(x), layer(x[7:8])
    assert tiles == [] and torch_rows == [45, 1] and torch.equal(together[7:8], alone)
    monkeypatch.setenv("KVSHARD_AMX_LINEAR", "0")
    other = ReplicatedLinear(64, 96, False, torch.bfloat16)
    assert reorder_linear_weights(other) == 1 and not other.amx_weight and other.packed_weight.is_mkldnn


@needs_amx
def test_the_lm_head_on_amx_tiles_reads_its_weight_and_keeps_no_copy():
    from kvshard.bench.decode_floor import weight_bytes_per_step

    torch.manual_seed(3)
    head = ParallelLMHead(96, 64, torch.bfloat16, single_rank_state())
    torch.nn.init.normal_(head.weight)
    model = torch.nn.Sequential(head)
    assert reorder_linear_weights(model) == 0  # the head is no linear layer; it keeps its product's form itself
    assert head.amx_weight and head.packed_weight is None and head.product_weight is None
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    got = head.logits(x)
    want = rounded_once(x, head.weight)
    assert got.dtype == torch.float32 and got.shape == (9, 96)
    assert ((got - want).abs() <= want.abs() * 2.0 ** -8 + 1e-4).all()
    # the tiles write the float32 logits themselves: the bfloat16 product's values, widened
    assert torch.equal(got, linear.amx_or_torch_product(x, head.weight, None).float())
    assert torch.equal(linear.amx_or_torch_product(x, head.weight, None, float_out=True), got)
    many = torch.randn(300, 64, dtype=torch.bfloat16)  # past the tiles' rows: torch's product, widened after
    assert torch.equal(head.logits(many), linear.amx_or_torch_product(many, head.weight, None).float())
    head.weight.data.zero_()  # the logits come from the weight itself
    assert not head.logits(x).any()
    assert weight_bytes_per_step(model, batch_size=4) == 96 * 64 * 2


@needs_amx
def test_the_compiled_steps_opaque_amx_product_is_the_eager_one():
    import kvshard.compilation  # noqa: F401 (registers torch.ops.kvshard.amx_linear)

    torch.manual_seed(4)
    weight, bias = torch.randn(48, 64, dtype=torch.bfloat16), torch.randn(48, dtype=torch.bfloat16)
    for rows in (3, 300):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        assert torch.equal(torch.ops.kvshard.amx_linear(x, weight, bias), linear.amx_or_torch_product(x, weight, bias))
    compiled = torch.compile(lambda x: linear.amx_product(x, weight, bias) * 2, dynamic=True, fullgraph=True)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(compiled(x), linear.amx_product(x, weight, bias) * 2)
