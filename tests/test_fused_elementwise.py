"""The fused CPU operators (kvshard/layers/fused.py: RMSNorm, SiLU-and-multiply, rotary embedding) against
their eager PyTorch forms and a float64 reference: odd widths (the 16-lane loops' tails), strided inputs, 3-D
inputs, arguments that overflow a naive exp, and rows computed alone against rows computed in a batch.
The models' exactness suites run with them on (the default); these tests pin each operator."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvshard.attention import fused_ops, paged
from kvshard.layers import fused
from kvshard.layers.activation import silu_and_mul, silu_and_mul_eager
from kvshard.layers.norm import RMSNorm
from kvshard.layers.rotary import apply_rotary, apply_rotary_eager

NO_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is None
pytestmark = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler found to build kvshard's kernel extension")

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def ops(fused_ops):  # this file's name for it: `fused_ops` here is the switch's module
    return fused_ops


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the dtype lie between a and b (same sign), elementwise."""
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return (a.view(view).to(torch.int64) - b.view(view).to(torch.int64)).abs()


def _assert_roundings_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: a few roundings apart; bfloat16: at most one representable value apart."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    else:
        assert _ulps_apart(got, want).max() <= 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 256), (37, 576), (3, 5, 50), (2000, 64)])
def test_rms_norm_matches_the_eager_form(ops, dtype, shape):
    torch.manual_seed(0)
    d = shape[-1]
    norm = RMSNorm(d, 1e-5, dtype)
    norm.weight.data = (torch.randn(d) * 0.5 + 1).to(dtype)
    x = (torch.randn(*shape) * 3).to(dtype)
    got, want = ops.rms_norm(x, norm.weight, norm.eps), norm.eager(x)
    assert got.shape == want.shape and got.dtype == dtype
    # the only difference: the float32 sum of squares adds up in another order (rstd a rounding or two apart)
    _assert_roundings_apart(got, want)
    x64 = x.double()
    exact = norm.weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)
    # the layer takes the fused path where the extension has its AVX-512 path, else the eager form
    assert torch.equal(norm(x), got if ops.tiled else want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_rows_and_does_not_depend_on_the_batch(ops, dtype):
    torch.manual_seed(1)
    norm = RMSNorm(72, 1e-6, dtype)
    norm.weight.data = torch.randn(72).to(dtype)
    wide = torch.randn(300, 200).to(dtype)
    x = wide[:, 10:82]  # rows 200 apart, channels contiguous
    got = ops.rms_norm(x, norm.weight, norm.eps)
    _assert_roundings_apart(got, norm.eager(x.contiguous()))
    alone = torch.cat([ops.rms_norm(x[i:i + 1], norm.weight, norm.eps) for i in range(x.shape[0])])
    assert torch.equal(got, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 256), (32, 576), (37, 50), (2000, 64)])
def test_the_residual_add_and_norm_give_the_bits_of_an_add_then_the_norm(ops, dtype, rows, d):
    """`add_rms_norm` (the decoder layers' residual add and the norm after it) against PyTorch's add followed by the
    extension's RMSNorm: the same bits, the sum rounded to the dtype first; d = 50 takes the loops' scalar tail, 2,000
    rows share the threads; the residual's rows may lie apart."""
    torch.manual_seed(5)
    norm = RMSNorm(d, 1e-5, dtype)
    norm.weight.data = (torch.randn(d) * 0.5 + 1).to(dtype)
    x = (torch.randn(rows, d) * 3).to(dtype)
    wide = (torch.randn(rows, d + 30) * 20).to(dtype)
    residual = wide[:, 7:7 + d]  # rows d + 30 apart
    x[0, :2], residual[0, :2] = torch.tensor([1e-39, 1 + 2 ** -8]), torch.tensor([0.0, 2 ** -9])  # subnormal; a tie
    out, total = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, x + residual)
    assert torch.equal(out, ops.rms_norm(x + residual, norm.weight, norm.eps))
    _assert_roundings_apart(out, norm.eager(x + residual))
    layer_out, layer_total = norm.add_and_norm(x, residual)  # what the layers call
    assert torch.equal(layer_total, total) and torch.equal(layer_out, out if ops.tiled else norm.eager(total))


def test_the_residual_add_keeps_to_the_eager_form_where_it_cannot_fuse(ops):
    norm = RMSNorm(40, 1e-5, torch.float32)
    x, residual = torch.randn(3, 4, 40), torch.randn(3, 4, 40)  # 3-D: the eager add and norm
    out, total = norm.add_and_norm(x, residual)
    assert torch.equal(total, x + residual) and torch.equal(out, norm(x + residual))
    with pytest.raises(RuntimeError, match="x and residual"):
        ops.add_rms_norm(torch.randn(3, 40), torch.randn(4, 40), norm.weight, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cache_write_puts_the_bits_index_copy_puts(ops, dtype):
    """`write_kv`: a step's keys and values (views of a fused projection's output) into their slots, against
    index_copy_; a value that is a view of the key (MLA) is left to the key; slots out of range are refused before
    anything is written."""
    torch.manual_seed(6)
    t, heads, d = 9, 3, 64
    qkv = torch.randn(t, (4 + 2 * heads) * d).to(dtype)
    k = qkv[:, 4 * d:(4 + heads) * d].view(t, heads, d)
    v = qkv[:, (4 + heads) * d:].view(t, heads, d)
    slots = torch.randperm(100)[:t]
    key, value = torch.zeros(100, heads, d, dtype=dtype), torch.zeros(100, heads, d, dtype=dtype)
    ops.write_kv(key, value, slots, k, v)
    want_key, want_value = torch.zeros_like(key), torch.zeros_like(value)
    want_key.index_copy_(0, slots, k)
    want_value.index_copy_(0, slots, v)
    assert torch.equal(key, want_key) and torch.equal(value, want_value)
    heads_apart = torch.randn(t, heads, 2 * d).to(dtype)[..., :d]  # each head's channels alone contiguous
    ops.write_kv(key, None, slots, heads_apart, None)
    want_key.index_copy_(0, slots, heads_apart)
    assert torch.equal(key, want_key) and torch.equal(value, want_value)
    before = key.clone()
    with pytest.raises(RuntimeError, match="slot 100 out of the cache's 100"):
        ops.write_kv(key, value, torch.tensor([3, 100]), k[:2], v[:2])
    with pytest.raises(RuntimeError, match="slot -1"):
        ops.write_kv(key, value, torch.tensor([-1]), k[:1], v[:1])
    assert torch.equal(key, before)
    with pytest.raises(RuntimeError, match="of its cache's dtype"):
        ops.write_kv(key, value, slots, k.float() if dtype != torch.float32 else k.double(), v)


def test_the_cache_layer_writes_through_the_extension_and_index_copy_alike(ops):
    from kvshard.kv.cache import FP8_DTYPE, KVCacheLayer, KVScales

    torch.manual_seed(7)
    k, v, slots = torch.randn(5, 2, 32).bfloat16(), torch.randn(5, 2, 32).bfloat16(), torch.tensor([9, 0, 4, 17, 2])
    layers = [KVCacheLayer(torch.zeros(20, 2, 32, dtype=torch.bfloat16), torch.zeros(20, 2, 32, dtype=torch.bfloat16),
                           4, torch.bfloat16) for _ in range(2)]
    layers[0].write(slots, k, v, ops)
    layers[1].write(slots, k, v)  # no extension: index_copy_
    assert torch.equal(layers[0].key, layers[1].key) and torch.equal(layers[0].value, layers[1].value)
    assert torch.equal(layers[0].key[slots], k)
    fp8 = KVCacheLayer(torch.zeros(20, 2, 32, dtype=FP8_DTYPE), torch.zeros(20, 2, 32, dtype=FP8_DTYPE), 4,
                       torch.bfloat16, KVScales(0.5, 0.25))
    fp8.write(slots, k, v, ops)  # rounded on the way in: the PyTorch path
    assert torch.equal(fp8.key[slots].to(torch.bfloat16), (k.float() / 0.5).to(FP8_DTYPE).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_attention_output_flattens_to_the_bits_of_to_then_flatten(ops, dtype):
    from kvshard.attention.fused_ops import flatten_heads

    torch.manual_seed(8)
    packed = torch.randn(33, 9, 65) * 4
    packed[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("inf"), 1e-40])  # ties to even, inf, tiny
    out = packed[..., :-1]  # the attention's output as a view of its packed [o | lse]
    got = ops.flatten_heads(out, dtype == torch.bfloat16)
    assert got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, out.to(dtype).flatten(1))
    assert torch.equal(flatten_heads(out, dtype), got)
    assert torch.equal(flatten_heads(out.half(), torch.float16), out.half().flatten(1))  # not fused: PyTorch's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 768), (9, 2 * 37), (4, 3, 2 * 64)])
def test_silu_and_mul_matches_the_eager_form(ops, dtype, shape):
    torch.manual_seed(2)
    x = (torch.randn(*shape) * 6).to(dtype)
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, -90.0, 90.0, -1000.0, 1000.0, -87.5, 1e-30]).to(dtype)
    got, want = ops.silu_and_mul(x), silu_and_mul_eager(x)
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.isfinite(got).all()
    assert (got.view(-1)[[2, 4]] == 0).all() and (want.view(-1)[[2, 4]] == 0).all()  # silu(-90), silu(-1000)
    x64 = x.double()
    gate, up = x64.chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    if dtype == torch.float32:  # another exp polynomial than PyTorch's: a few float32 roundings apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-30)
    else:  # rounded to bfloat16 twice, as the eager operators round; past -87 both give 0 where the exact is < 1e-36
        apart = _ulps_apart(got, want)[(want.abs() > 1e-30) | (got.abs() > 1e-30)]
        assert apart.max() <= 1 and (apart > 0).float().mean() < 0.01
        torch.testing.assert_close(got.double(), exact, rtol=2e-2, atol=1e-30)
    assert torch.equal(silu_and_mul(x), got if ops.tiled else want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("heads,d", [(8, 32), (9, 64), (1, 20), (3, 2)])
def test_rotary_gives_the_eager_bits(ops, dtype, interleaved, heads, d):
    torch.manual_seed(3)
    t = 23
    qkv = (torch.randn(t, (heads + 2) * d) * 2).to(dtype)
    x = qkv[:, :heads * d].view(t, heads, d)  # a view of a fused projection: token stride (heads + 2) * d
    angles = torch.randn(t, d // 2) * 5
    cos, sin = angles.cos(), angles.sin()
    got, want = ops.rotary(x, cos, sin, interleaved), apply_rotary_eager(x, cos, sin, interleaved)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    # the same products, rounded one by one (no fused multiply-add), on one thread or two
    assert torch.equal(got, want)
    assert torch.equal(apply_rotary(x, cos, sin, interleaved), got)


def test_rotary_many_tokens_on_every_thread(ops):
    """Enough tokens that the threads share them: each thread's products are rounded as the eager ones."""
    torch.manual_seed(4)
    x = torch.randn(4000, 8, 64)
    angles = torch.randn(4000, 32)
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(ops.rotary(x, cos, sin, False), apply_rotary_eager(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_with_no_rows(ops, dtype):
    norm = RMSNorm(64, 1e-5, dtype)
    assert ops.rms_norm(torch.empty(0, 64, dtype=dtype), norm.weight, 1e-5).shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 2 * 48, dtype=dtype)).shape == (0, 48)
    empty = torch.empty(0, 16)
    assert ops.rotary(torch.empty(0, 4, 32, dtype=dtype), empty, empty, False).shape == (0, 4, 32)


def test_what_takes_the_fused_path(ops, monkeypatch):
    x32, x16 = torch.randn(4, 64), torch.randn(4, 64).half()
    assert fused.ops_for(x32) is ops and fused.ops_for(x32.bfloat16()) is ops
    assert fused.ops_for(x16) is None  # float16: PyTorch's operators
    if ops.tiled:
        assert fused.ops_for(x32, avx512=True) is ops
    calls = []
    monkeypatch.setattr(fused, "ops_for", lambda x, avx512=False: calls.append(x) or None)
    norm = RMSNorm(64, 1e-5, torch.float32)
    assert torch.equal(norm(x32), norm.eager(x32))  # no extension: the eager form
    assert calls


def test_a_build_without_avx512_fuses_the_rotary_embedding_alone(ops, monkeypatch):
    """Built for AVX2, the fused RMSNorm and SiLU ran slower than PyTorch's (BENCHMARKS.md section 22)."""

    class Avx2Build:
        tiled = False
        rotary = staticmethod(ops.rotary)

    monkeypatch.setattr(fused_ops, "_ops", Avx2Build())
    x = torch.randn(6, 4, 32)
    angles = torch.randn(6, 16)
    assert fused.ops_for(x) is not None and fused.ops_for(x, avx512=True) is None
    norm = RMSNorm(32, 1e-5, torch.float32)
    assert torch.equal(norm(x), norm.eager(x))  # the eager form, without an rms_norm on the stub
    assert torch.equal(silu_and_mul(x), silu_and_mul_eager(x))
    assert torch.equal(apply_rotary(x, angles.cos(), angles.sin()), ops.rotary(x, angles.cos(), angles.sin(), False))
    from kvshard.engine.arg_utils import EngineArgs

    monkeypatch.setattr(paged, "load_extension", lambda: Avx2Build())
    config = EngineArgs(model="kvshard-demo-gqa", dtype="bfloat16").create_engine_config()
    assert ("fused C++ rotary embedding, cache write and LSE merge; PyTorch's eager RMSNorm"
            in fused.describe(config, "cpu"))


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv("KVSHARD_FUSED_ELEMENTWISE", "0")
    fused.reset()
    try:
        assert fused.cpu_ops() is None and fused.ops_for(torch.randn(2, 8)) is None
        assert paged.load_extension() is not None  # the extension itself stays built
        x = torch.randn(5, 2 * 40)
        assert torch.equal(silu_and_mul(x), silu_and_mul_eager(x))
    finally:
        fused.reset()


def test_the_start_up_report_names_them(ops, monkeypatch):
    from kvshard.engine.arg_utils import EngineArgs

    config = EngineArgs(model="kvshard-demo-gqa", dtype="bfloat16").create_engine_config()
    assert ("elementwise operators: fused C++ RMSNorm" if ops.tiled else
            "elementwise operators: fused C++ rotary embedding, cache write and LSE merge; PyTorch's eager RMSNorm"
            ) in config.layout_report()
    assert "(fused on a CPU only)" in fused.describe(config, "cuda")
    half = EngineArgs(model="kvshard-demo-gqa", dtype="float16").create_engine_config()
    assert "(fused for float32 and bfloat16 only)" in fused.describe(half, "cpu")
    compiled = EngineArgs(model="kvshard-demo-gqa", compilation_config=3).create_engine_config()
    assert "inductor's, fused in the compiled model step" in fused.describe(compiled, "cpu")
    assert "MoE router" not in fused.describe(config, "cpu")  # no routed experts
    moe = EngineArgs(model="kvshard-demo-mla").create_engine_config()
    assert fused.describe(moe, "cpu").endswith("; the MoE router's choice: fused C++")
    assert fused.describe(moe, "cuda").endswith("; the MoE router's choice: PyTorch's operators")
    compiled_moe = EngineArgs(model="kvshard-demo-mla", compilation_config=3).create_engine_config()
    assert fused.describe(compiled_moe, "cpu").endswith("; the MoE router's choice: PyTorch's operators")
    monkeypatch.setenv("KVSHARD_FUSED_ELEMENTWISE", "0")
    fused.reset()  # the switch is read once, as an engine reads it at start-up
    try:
        assert "(KVSHARD_FUSED_ELEMENTWISE=0)" in fused.describe(config, "cpu")
        assert fused.describe(moe, "cpu").endswith("; the MoE router's choice: PyTorch's operators")
    finally:
        fused.reset()
