"""The paged attention kernel (kvshard/attention/paged.py) against the plain-matmul reference.

Caches are random, block tables shuffled, and what each row sees is what a DCP rank holds under
the layout (interleaves 1 / 4 / 16), so a rank may hold no token of a short request (lse -inf).
The oracle gathers each row's visible tokens with plain indexing and runs
`reference_attention_with_lse` in float32 on the dequantized values.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvshard.attention import paged
from kvshard.attention.kernels import reference_attention_with_lse
from kvshard.kv.cache import FP8_DTYPE, FP8_MAX
from kvshard.kv.layout import DCPLayout

# skipped only where no C++ compiler is found; where one is, a failed build fails the test below
NO_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is None
pytestmark = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler found to build the paged attention kernel")


def test_the_kernel_builds_where_a_compiler_is_found():
    assert paged.kernel_available(), "the paged attention kernel did not build (see the warning logged)"


def _cache(num_blocks, block_size, kv_heads, dk, dv, dtype, mla, k_scale=1.0, v_scale=1.0, seed=0):
    """key [slots, Hk, dk] and value (a prefix view of the key for MLA) in `dtype`, with the
    float32 values they stand for (after the scales)."""
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    if mla:
        real_k = torch.randn(slots, kv_heads, dk, generator=g)
        real_v = None
    else:
        real_k = torch.randn(slots, kv_heads, dk, generator=g)
        real_v = torch.randn(slots, kv_heads, dv, generator=g)

    def store(x, scale):
        if dtype == FP8_DTYPE:
            return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return x.to(dtype)

    key = store(real_k, k_scale)
    if mla:
        value = key[..., :dv]
        value_scale = k_scale
    else:
        value = store(real_v, v_scale)
        value_scale = v_scale
    key_f = key.float() * k_scale
    value_f = value.float() * value_scale
    return key, value, key_f, value_f, value_scale


def _tables(num_seqs, max_blocks, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks]
    return ids.view(num_seqs, max_blocks).to(torch.int32)


def _oracle(q, key_f, value_f, tables, row_seq, row_lens, block_size, scale):
    """Per row: its visible tokens by plain indexing, then the reference."""
    t, heads = q.shape[:2]
    out = torch.zeros(t, heads, value_f.shape[-1])
    lse = torch.full((t, heads), float("-inf"))
    for r in range(t):
        n = int(row_lens[r])
        if n == 0:
            continue
        j = torch.arange(n)
        slots = tables[int(row_seq[r])].long()[j // block_size] * block_size + j % block_size
        k, v = key_f[slots][None], value_f[slots][None]  # [1, n, Hk, d]
        o, l = reference_attention_with_lse(q[r:r + 1].float()[None], k, v, torch.zeros(1, 1, n), scale)
        out[r], lse[r] = o[0, 0], l[0, 0]
    return out, lse


def _check(out, lse, ref_out, ref_lse, atol, rtol):
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "rows with no key must have lse -inf, and only they"
    assert torch.all(out[empty] == 0)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=atol, rtol=rtol)
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=rtol)


def _paged_kernel(q, key, value, tables, row_seq, row_lens, block_size, scale, k_scale, v_scale, split_tokens=0,
                  path="chosen"):
    return paged.paged_attention(q, key, value, tables, row_seq, row_lens, block_size, scale, k_scale, v_scale,
                                 split_tokens=split_tokens, use_kernel=True, portable=path == "portable",
                                 vector_lanes=path in ("chosen", "vector-lanes"),
                                 amx_tiles=None if path == "chosen" else path == "amx")


@pytest.fixture(params=["chosen", "vector-lanes", "token-lanes", "portable"])
def path(request):
    """Each kernel case on each of the kernel's paths: as chosen (bfloat16 keys that fit them on AMX tiles where the
    CPU has them; else the AVX-512 tiles with the query vectors in the lanes for items of 16 vectors or a multiple,
    else the tokens), the AVX-512 tiles so with no AMX tiles, the AVX-512 tiles with the tokens in the lanes for
    every item (where the CPU has no AVX-512, these run the portable loops), and the portable loops."""
    return request.param


def _on_amx_tiles(q_dtype, cache_dtype, dk) -> bool:
    """Whether the kernel, as chosen, takes the AMX tiles' path for these rows (`amx_ready`, the kernel loaded)."""
    paged.load_extension()
    return (paged.amx_ready() and q_dtype == torch.bfloat16 and cache_dtype == torch.bfloat16 and dk % 32 == 0
            and dk <= 128)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_the_avx512_tiles_are_built_where_the_cpu_has_them():
    module = paged.load_extension()
    assert module is not None
    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert module.tiled == (wanted <= _cpu_flags())


def test_the_kernel_runs_on_torchs_threads():
    # at::parallel_for is a header template: the extension runs it on one thread unless built with OpenMP
    module = paged.load_extension()
    threads = torch.get_num_threads()
    assert module.parallel_threads(64) == min(threads, 64)
    if threads == 1:
        torch.set_num_threads(2)
        try:
            assert module.parallel_threads(64) == 2
        finally:
            torch.set_num_threads(1)


def test_the_kernels_run_with_pythons_lock_released():
    """rank 0's engine loop runs in the server's process: while a kernel runs, the event loop's thread must run too
    (as it does while PyTorch's own operators run), not only between calls. A thread stamps the time as fast as it
    can; holding Python's lock for a call leaves a gap in its stamps as long as the call (less the moment the thread
    may still run after the call's start is read: 85-95% of it here), letting it go only the scheduler's gaps."""
    import threading
    import time

    module = paged.load_extension()
    rows, keys = 64, 65536  # one request's keys as one block, every row over all of them: ~0.1 s
    q, k, v = torch.randn(rows, 8, 64), torch.randn(keys, 1, 64), torch.randn(keys, 1, 64)
    calls = {  # the arguments made beforehand: PyTorch's operators let the lock go themselves
        "paged_attention": (module.paged_attention, (
            q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(rows, dtype=torch.int32),
            torch.full((rows,), keys, dtype=torch.int32), keys, 0.125, 1.0, 1.0, 0, False, True, False)),
    }
    if module.amx_ready():  # 256 rows over a 16,384 x 4,096 weight: ~0.1 s
        calls["amx_linear"] = (module.amx_linear, (torch.randn(256, 4096, dtype=torch.bfloat16),
                                                   torch.randn(16384, 4096, dtype=torch.bfloat16), None))
    stamps: list[float] = []
    stop = threading.Event()

    def stamp() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=stamp, daemon=True)
    thread.start()
    try:
        for name, (call, args) in calls.items():
            start = time.perf_counter()
            call(*args)
            end = time.perf_counter()
            during = [start] + [t for t in stamps if start < t < end] + [end]
            gap = max(b - a for a, b in zip(during, during[1:]))
            assert gap < (end - start) * 2 / 3, f"{name} held Python's lock: no other thread ran for {1e3 * gap:.0f} " \
                                             f"of its {1e3 * (end - start):.0f} ms"
    finally:
        stop.set()
        thread.join()


def test_threads_share_a_chunks_rows_and_give_the_bits_of_one():
    # the units go to whichever thread is free, the most work first (a causal chunk's last rows see the most
    # keys): each is computed alone, so one thread and two give the same bits
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(700, h, d, generator=g) for h, d in ((4, 64), (4, 64), (4, 32)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged.causal_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        assert paged.load_extension().parallel_threads(64) == 2
        two = paged.causal_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def _run(*, heads, kv_heads, dk, dv, block_size, interleave, dcp, rank, context_lens, query_lens, dtype=torch.float32,
         cache_dtype=None, mla=False, causal=True, k_scale=1.0, v_scale=1.0, atol=2e-5, rtol=2e-5,
         seed=0, kernel=_paged_kernel, **kernel_options):
    """One random case through `kernel` (the C++ one by default; tests/test_triton_attention.py passes
    the Triton one) against the oracle; `kernel_options` go to the kernel (split_tokens, num_splits, ...)."""
    cache_dtype = cache_dtype or dtype
    layout = DCPLayout(block_size, dcp, interleave)
    local_max = max(layout.local_len(c, rank) for c in context_lens)
    max_blocks = max(1, -(-local_max // block_size)) + 1
    num_blocks = len(context_lens) * max_blocks + 3
    key, value, key_f, value_f, value_scale = _cache(num_blocks, block_size, kv_heads, dk, dv, cache_dtype, mla,
                                                     k_scale, v_scale, seed)
    tables = _tables(len(context_lens), max_blocks, num_blocks, seed)
    row_seq, row_lens = paged.row_lens_of(context_lens, query_lens, layout, rank, causal=causal)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(int(row_seq.numel()), heads, dk, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(dk)
    out, lse = kernel(q, key, value, tables, row_seq, row_lens, block_size, scale, k_scale, value_scale,
                      **kernel_options)
    ref_out, ref_lse = _oracle(q, key_f, value_f, tables, row_seq, row_lens, block_size, scale)
    if (kernel_options.get("path") in ("chosen", "vector-lanes") and dtype == torch.bfloat16
            and cache_dtype == torch.bfloat16
            and not (kernel_options["path"] == "chosen" and _on_amx_tiles(dtype, cache_dtype, dk))):
        # where the vector lanes apply, a bfloat16 cache's values are weighed by the softmax weights rounded to
        # bfloat16 (as PyTorch's flash kernel does for bfloat16): up to 2^-9 of each weight (on the AMX tiles' path
        # they stay float32)
        atol, rtol = max(atol, 4e-3), max(rtol, 4e-3)
    _check(out, lse, ref_out, ref_lse, atol, rtol)
    return row_lens


GQA = [(8, 1, 64), (9, 3, 32)]  # (query heads, KV heads, head dim): as the demo and SmolLM2


@pytest.mark.parametrize("heads,kv_heads,d", GQA)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("interleave,dcp,rank", [(1, 1, 0), (1, 2, 1), (4, 4, 3), (16, 2, 1)])
def test_decode_rows_match_reference_fp32(heads, kv_heads, d, block_size, interleave, dcp, rank, path):
    lens = _run(path=path,
                heads=heads, kv_heads=kv_heads, dk=d, dv=d, block_size=block_size, interleave=interleave, dcp=dcp,
                rank=rank, context_lens=[1, 5, 37, 130, 300], query_lens=[1] * 5)
    if dcp > 1:
        assert int(lens.min()) == 0  # a short request this rank holds none of: checked as lse -inf


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads,kv_heads,d,interleave,dcp", [(8, 1, 64, 4, 2), (9, 3, 32, 1, 1)])
def test_several_query_rows_per_request_causal(block_size, heads, kv_heads, d, interleave, dcp, path):
    # speculative verification / a chunk's rows over the cache: each row sees up to its own position
    # (with 3 heads per KV head, vectors of rows with different bounds share the kernel's groups of 4)
    lens = _run(path=path,
                heads=heads, kv_heads=kv_heads, dk=d, dv=d, block_size=block_size, interleave=interleave, dcp=dcp,
                rank=0, context_lens=[6, 90, 200], query_lens=[4, 3, 17])
    assert len(set(lens[:4].tolist())) > 1  # the rows of one request really have different bounds


def test_rows_without_causal_bound(path):
    _run(path=path,
         heads=9, kv_heads=3, dk=32, dv=32, block_size=16, interleave=1, dcp=1, rank=0, context_lens=[40, 70],
         query_lens=[3, 2], causal=False)


@pytest.mark.parametrize("heads", [8, 16])
@pytest.mark.parametrize("split_tokens", [16, 48, 100])
def test_split_along_the_sequence_merges_exactly(split_tokens, heads, path):
    _run(path=path, heads=heads, kv_heads=1, dk=64, dv=64, block_size=16, interleave=1, dcp=2, rank=1,
         context_lens=[3, 250, 600], query_lens=[1, 1, 2], split_tokens=split_tokens)


def test_mla_latent_value_is_a_prefix_of_the_key(path):
    # MLA absorbed: 16 query heads on one latent [c_kv | k_pe] (dk = 72), V = its first 64 channels
    _run(path=path, heads=16, kv_heads=1, dk=72, dv=64, block_size=16, interleave=4, dcp=2, rank=1,
         context_lens=[2, 77, 260], query_lens=[1, 1, 3], mla=True)
    _run(path=path,
         heads=16, kv_heads=1, dk=72, dv=64, block_size=64, interleave=16, dcp=4, rank=2, context_lens=[9, 300],
         query_lens=[1, 1], mla=True, dtype=torch.bfloat16, atol=2e-2, rtol=2e-2, split_tokens=64)


@pytest.mark.parametrize("heads", [8, 24])
@pytest.mark.parametrize("block_size,dk,dv", [(8, 576, 512), (24, 520, 512), (1, 513, 512), (16, 72, 64)])
def test_float32_latent_at_8_heads(block_size, dk, dv, heads, path):
    # MLA's absorbed step at 8 heads a rank (Kimi K2's 64 at tp=8) or 24, in float32: 8 vector lanes on a latent of
    # 512 channels or more (16 lanes for neither), the token lanes on a narrow one (72); short tiles at blocks of
    # 8 and 1, a channel tail of 8 (520) and an odd key width (513); rows of 1 to 3 per request, each seeing up to
    # its own position
    _run(path=path, heads=heads, kv_heads=1, dk=dk, dv=dv, block_size=block_size, interleave=1, dcp=2, rank=1,
         context_lens=[2, 45, 130, 301], query_lens=[1, 3, 1, 2], mla=True)


@pytest.mark.parametrize("heads", [8, 16])  # 16: one item of 16 vectors, so the vector-lane path on the tiles
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_half_caches(cache_dtype, heads, path):
    # bf16/fp16 caches and queries: the oracle runs float32 on the same stored values
    _run(path=path,
         heads=heads, kv_heads=1, dk=64, dv=64, block_size=16, interleave=1, dcp=2, rank=0, context_lens=[1, 40, 333],
         query_lens=[1, 1, 1], dtype=cache_dtype, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mla,heads", [(False, 9), (True, 8), (True, 16)])
def test_fp8_caches_with_scales(mla, heads, path):
    dk, dv = (72, 64) if mla else (64, 64)
    _run(path=path,
         heads=heads, kv_heads=3 if not mla else 1, dk=dk, dv=dv, block_size=16, interleave=4, dcp=2,
         rank=1, context_lens=[3, 50, 200], query_lens=[1, 2, 1], cache_dtype=FP8_DTYPE, mla=mla,
         k_scale=0.05, v_scale=0.02, dtype=torch.float32)
    _run(path=path,
         heads=heads if mla else 8, kv_heads=1, dk=dk, dv=dv, block_size=64, interleave=1, dcp=1, rank=0,
         context_lens=[70, 129], query_lens=[1, 1], cache_dtype=FP8_DTYPE, mla=mla, k_scale=0.05, v_scale=0.02,
         dtype=torch.bfloat16, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (8, 1), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,d", [(8, 64), (24, 36), (48, 33), (1, 64)])
def test_tiles_across_block_and_channel_bounds(block_size, d, dtype, heads, kv_heads, path):
    # tiles are 16 tokens of one block: blocks of 8 (short tiles), 24 and 48 (a 16-token tile and a shorter one),
    # 1; channels not a multiple of 16 (36: a tail of 4; bfloat16 pairs with a tail of 2) and odd (33: no pairs,
    # and on the vector-lane path each tile's keys converted to float32); 16 heads on one KV head: the vector lanes,
    # with rows of 1, 3 and 2 (16, 48, 32 vectors) and rows that see fewer tokens than the tile holds; 8 on one:
    # 8 vector lanes where the scores are bfloat16 pairs, token lanes for one row in float32, 16 for two rows
    tol = 1e-4 if dtype == torch.bfloat16 else 2e-5
    _run(path=path, heads=heads, kv_heads=kv_heads, dk=d, dv=d, block_size=block_size, interleave=1, dcp=1, rank=0,
         context_lens=[1, 17, 50, 97], query_lens=[1, 3, 1, 2], dtype=dtype, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dk,dv,mla", [(8, 1, 64, 64, False), (9, 3, 32, 32, False),
                                                      (16, 1, 72, 64, True), (8, 1, 576, 512, True)])
def test_a_row_among_several_computes_the_bits_of_its_decode(heads, kv_heads, dk, dv, mla, dtype, path):
    # speculative verification rows (and the rest of a prompt) read the cache as decodes of their tokens would:
    # each row, computed with the request's other rows in one item, gives the same bits as alone (the kernel's
    # lanes are chosen by the heads, not by the rows, and a vector's sums do not depend on its group)
    key, value, *_ = _cache(40, 16, kv_heads, dk, dv, dtype, mla)
    tables = _tables(2, 20, 40)
    row_seq = torch.tensor([0] * 4 + [1] * 2 + [0], dtype=torch.int32)  # items of 4, 2 and 1 rows
    row_lens = torch.tensor([200, 201, 202, 203, 38, 39, 204], dtype=torch.int32)
    q = torch.randn(7, heads, dk, generator=torch.Generator().manual_seed(3)).to(dtype)
    together = _paged_kernel(q, key, value, tables, row_seq, row_lens, 16, 0.125, 1.0, 1.0, split_tokens=1 << 20,
                             path=path)
    for r in range(7):
        alone = _paged_kernel(q[r:r + 1], key, value, tables, row_seq[r:r + 1], row_lens[r:r + 1], 16, 0.125, 1.0,
                              1.0, split_tokens=1 << 20, path=path)
        assert torch.equal(alone[0], together[0][r:r + 1]) and torch.equal(alone[1], together[1][r:r + 1]), r


def test_all_rows_empty(path):
    # a DCP rank that holds no token of any request in the step
    _run(path=path,
         heads=8, kv_heads=1, dk=64, dv=64, block_size=16, interleave=16, dcp=4, rank=3, context_lens=[3, 10],
         query_lens=[1, 1])


AMX_CASES = [(9, 3, 64), (6, 2, 32), (32, 8, 128), (16, 2, 64), (8, 1, 32), (8, 8, 32), (96, 8, 64)]


@pytest.mark.skipif(not (paged.kernel_available() and paged.amx_ready()), reason="no AMX tiles here (CPU or system)")
@pytest.mark.parametrize("heads,kv_heads,d", AMX_CASES)
@pytest.mark.parametrize("block_size,interleave,dcp,rank,split", [(16, 1, 1, 0, 0), (8, 4, 2, 1, 0),
                                                                  (24, 8, 4, 3, 0), (1, 1, 1, 0, 0),
                                                                  (16, 1, 2, 0, 48)])
def test_amx_tiles_decode_and_verify_rows(heads, kv_heads, d, block_size, interleave, dcp, rank, split):
    # bfloat16 rows on the AMX tiles' path: SmolLM2's 9 heads on 3 KV heads, Llama-3-8B's 32 on 8 at head size 128,
    # the demo's 8 on 1 at 32, 8 on 8 (a KV head a query head), and 96 on 8 (more heads than a unit takes whole: a
    # unit a KV head); blocks of 8 and 1 (tiles shorter than 16 tokens, copied before the tile load) and 24 (a
    # 16-token tile and an 8); DCP ranks that hold none of a short request; rows of 1 to 5 per request, each seeing
    # up to its own position; the sequence split into pieces. The values are weighed in float32: as close to the
    # float32 oracle as the token-lane path.
    options = dict(split_tokens=split) if split else {}
    _run(path="amx", heads=heads, kv_heads=kv_heads, dk=d, dv=d, block_size=block_size, interleave=interleave,
         dcp=dcp, rank=rank, context_lens=[1, 5, 40, 150, 333], query_lens=[1, 5, 1, 2, 1], dtype=torch.bfloat16,
         atol=1e-4, rtol=1e-4, **options)


@pytest.mark.skipif(not (paged.kernel_available() and paged.amx_ready()), reason="no AMX tiles here (CPU or system)")
def test_amx_tiles_are_the_path_chosen_and_another_path_than_the_vector_registers():
    # as chosen, bfloat16 keys of head size 64 take the AMX tiles (their sums run in another order than the vector
    # registers': other bits), and a float32 query or a head size the tiles do not take stays on the vector path
    key, value, *_ = _cache(40, 16, 3, 64, 64, torch.bfloat16, False)
    tables = _tables(2, 20, 40)
    row_seq, row_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([300, 120], dtype=torch.int32)
    q = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    args = (q, key, value, tables, row_seq, row_lens, 16, 0.125, 1.0, 1.0)
    chosen, amx, vector = (_paged_kernel(*args, path=p) for p in ("chosen", "amx", "vector-lanes"))
    assert torch.equal(chosen[0], amx[0]) and not torch.equal(amx[0], vector[0])
    torch.testing.assert_close(amx[0], vector[0], atol=1e-5, rtol=1e-5)
    qf = q.float()
    assert torch.equal(_paged_kernel(qf, *args[1:], path="chosen")[0], _paged_kernel(qf, *args[1:], path="amx")[0])


def test_gather_fallback_agrees_with_kernel():
    layout = DCPLayout(16, 2, 4)
    key, value, *_ = _cache(20, 16, 3, 32, 32, torch.float32, False)
    tables = _tables(3, 6, 20)
    row_seq, row_lens = paged.row_lens_of([5, 100, 170], [1, 2, 1], layout, 0)
    q = torch.randn(4, 9, 32)
    kernel = paged.paged_attention(q, key, value, tables, row_seq, row_lens, 16, 0.2, use_kernel=True)
    fallback = paged.paged_attention(q, key, value, tables, row_seq, row_lens, 16, 0.2, use_kernel=False)
    _check(*kernel, *fallback, atol=2e-5, rtol=2e-5)


def test_bad_inputs_are_refused():
    key, value, *_ = _cache(4, 16, 1, 64, 64, torch.float32, False)
    q = torch.randn(1, 8, 64)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row_lens past the block table"):
        paged.paged_attention(q, key, value, tables, torch.tensor([0]), torch.tensor([33]), 16, 1.0, use_kernel=True)
    with pytest.raises(RuntimeError, match="block id out of range"):
        paged.paged_attention(q, key, value, torch.tensor([[0, 9]]), torch.tensor([0]), torch.tensor([20]), 16, 1.0,
                              use_kernel=True)


# --- the backends (kvshard/attention/backends.py) on a step's metadata ---------------------------

def step_cache(mla: bool, num_blocks: int, rows: int, seed: int, cache_dtype=None, scales=None):
    """A step's random paged cache, blocks of 16 (MLA's latent: 16 heads on a 72-channel key, V its first 64
    channels; else 9 heads on 3 KV heads of 32) and `rows` queries for it: (cache, q)."""
    from kvshard.kv.cache import KVCacheSpec, allocate_kv_cache

    spec, heads = (KVCacheSpec(1, 1, key_dim=72, value_dim=64, value_in_key=True), 16) if mla else \
        (KVCacheSpec(1, 3, key_dim=32, value_dim=32, value_in_key=False), 9)
    (cache,) = allocate_kv_cache(spec, num_blocks, 16, torch.float32, torch.device("cpu"), cache_dtype=cache_dtype,
                                 scales=scales)
    g = torch.Generator().manual_seed(seed)
    cache.write(torch.arange(cache.key.shape[0]), torch.randn(cache.key.shape, generator=g),
                torch.randn(cache.value.shape, generator=g))
    return cache, torch.randn(rows, heads, spec.key_dim, generator=g)


@pytest.mark.parametrize("kind", ["gqa", "mla", "fp8"])
def test_backends_agree_on_a_step(kind):
    from kvshard.attention.backends import make_backend
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.kv.cache import KVScales

    block_size, dcp, rank = 16, 2, 1
    layout = DCPLayout(block_size, dcp, 4)
    # decodes of spread-out lengths (several groups), one of them too short for this rank, then a
    # prefill chunk continuing a cached prompt, then a first chunk (no context: past context_rows)
    context_lens, query_lens = [2, 40, 41, 300, 64, 0], [1, 1, 1, 1, 5, 3]
    tables = [[(7 * i + 3 * j) % 64 for j in range(12)] for i in range(6)]
    meta = AttentionMetadata.build(context_lens, query_lens, tables, layout, rank, torch.device("cpu"),
                                   decode_group_spread=0)
    assert len(meta.groups) > 3 and meta.context_rows == 9
    fp8 = kind == "fp8"
    cache, q = step_cache(kind == "mla", 64, meta.context_rows, 5, cache_dtype=FP8_DTYPE if fp8 else None,
                          scales=[KVScales(0.05, 0.03)] if fp8 else None)
    assert meta.row_lens.tolist()[0] == 0  # rank 1 holds none of the 3-token request: lse -inf below
    results = {name: make_backend(name).attend_context(q, cache, meta, 0.2)
               for name in ("reference", "gather", "paged")}
    ref_out, ref_lse = results["reference"]
    assert torch.isneginf(ref_lse[0]).all() and torch.isfinite(ref_lse[1:]).all()
    for name in ("gather", "paged"):
        _check(*results[name], ref_out, ref_lse, atol=1e-5, rtol=1e-5)


def test_without_a_compiler_one_log_line_and_the_gather_path(monkeypatch, caplog):
    # a machine with no C++ compiler: no build is tried, one line says why, the gather path answers
    monkeypatch.setattr(paged, "_module", None)
    monkeypatch.setattr(paged, "_unavailable", None)
    monkeypatch.setenv("CXX", "kvshard-no-such-compiler")
    key, value, key_f, value_f, _ = _cache(8, 16, 1, 64, 64, torch.float32, False)
    tables = _tables(2, 3, 8)
    row_seq, row_lens = paged.row_lens_of([20, 40], [1, 1], DCPLayout(16, 1), 0)
    q = torch.randn(2, 8, 64)
    with caplog.at_level("WARNING", logger="kvshard.attention.paged"):
        assert not paged.kernel_available()
        out, lse = paged.paged_attention(q, key, value, tables, row_seq, row_lens, 16, 0.125)
        paged.paged_attention(q, key, value, tables, row_seq, row_lens, 16, 0.125)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C++ compiler (kvshard-no-such-compiler)" in lines[0] and "gather path" in lines[0]
    _check(out, lse, *_oracle(q, key_f, value_f, tables, row_seq, row_lens, 16, 0.125), atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match="unavailable"):
        paged.paged_attention(q, key, value, tables, row_seq, row_lens, 16, 0.125, use_kernel=True)


def test_the_build_compiles_a_copy_in_its_folder_so_checkouts_at_other_paths_share_it(monkeypatch, tmp_path):
    # ninja rebuilds when a source's path changes: two checkouts (one source, two paths) loading the source
    # where it lies would rebuild in turn, each in the other's build folder; the copy's path is the folder's
    import torch.utils.cpp_extension

    loads = []
    monkeypatch.setattr(paged, "_module", None)
    monkeypatch.setattr(paged, "_unavailable", None)
    monkeypatch.setenv("KVSHARD_KERNEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(paged, "_ninja_on_path", lambda: True)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: loads.append(kwargs) or "module")
    for checkout in ("a", "b"):
        source = tmp_path / checkout / "paged_attention.cpp"
        source.parent.mkdir()
        source.write_bytes(paged._SOURCE.read_bytes())
        monkeypatch.setattr(paged, "_SOURCE", source)
        monkeypatch.setattr(paged, "_module", None)
        assert paged.load_extension() == "module"
    first, second = loads
    assert first["sources"] == second["sources"] and first["build_directory"] == second["build_directory"]
    (compiled,) = first["sources"]
    assert Path(compiled).parent == Path(first["build_directory"]) and Path(compiled).read_bytes() == \
        paged._SOURCE.read_bytes()


@pytest.mark.parametrize("heads,kv_heads,dk,dv", [(4, 4, 64, 32), (9, 3, 32, 32), (8, 1, 64, 64), (16, 1, 24, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_attend_to_themselves_in_the_kernel(heads, kv_heads, dk, dv, dtype):
    # prefill chunks' causal attention to their own K/V (MLA's expanded form: 64-channel keys, 32-channel values):
    # the paged backend reads each chunk in place through the kernel, row i seeing keys 0..i; a decode and a chunk
    # after cached context read in the cache (no attention to themselves: lse -inf, o 0 here)
    from kvshard.attention.backends import make_backend
    from kvshard.attention.metadata import AttentionMetadata

    layout = DCPLayout(16, 1, 1)
    context_lens, query_lens = [30, 20, 0, 0, 0], [1, 4, 2, 37, 130]
    tables = [[(5 * i + j) % 64 for j in range(12)] for i in range(5)]
    meta = AttentionMetadata.build(context_lens, query_lens, tables, layout, 0, torch.device("cpu"))
    assert [g.attends_itself for g in meta.groups] == [False, False, True, True, True]
    t = sum(query_lens)
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(t, h, dk, generator=g).to(dtype) for h in (heads, kv_heads))
    v = torch.randn(t, kv_heads, 2 * dv, generator=g).to(dtype)[..., :dv]  # a strided view, as a split projection
    ref_out, ref_lse = make_backend("reference").attend_chunks(q, k, v, meta, 0.3)
    out, lse = make_backend("paged").attend_chunks(q, k, v, meta, 0.3)
    assert torch.isneginf(lse[:5]).all() and not out[:5].any()
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    _check(out, lse, ref_out, ref_lse, tol, tol)


@pytest.mark.parametrize("mla", [False, True])
def test_a_long_chunk_reads_its_cached_context_in_the_kernel(mla):
    # a chunk of more than 16 rows after cached context (the rest of a long prompt, a turn after a prefix hit): its
    # rows all see the context cached before the chunk, read by the kernel as the decodes' are, here on DCP rank 1
    from kvshard.attention.backends import make_backend
    from kvshard.attention.metadata import AttentionMetadata

    layout = DCPLayout(16, 2, 4)
    context_lens, query_lens = [57, 300, 0], [1, 40, 30]
    tables = [[(7 * i + 3 * j) % 64 for j in range(16)] for i in range(3)]
    meta = AttentionMetadata.build(context_lens, query_lens, tables, layout, 1, torch.device("cpu"))
    assert [g.attends_itself for g in meta.groups] == [False, True, True] and meta.context_rows == 41
    cache, q = step_cache(mla, 64, meta.context_rows, 9)
    ref_out, ref_lse = make_backend("reference").attend_context(q, cache, meta, 0.2)
    out, lse = make_backend("paged").attend_context(q, cache, meta, 0.2)
    assert torch.isfinite(ref_lse).all()
    _check(out, lse, ref_out, ref_lse, atol=1e-5, rtol=1e-5)
