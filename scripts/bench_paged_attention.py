"""Micro-benchmark of attention over the paged KV cache on CPU: decode rows of a batch over
their cached context.

Compares the paged kernel (kvshard/attention/paged.py: reads the blocks where they lie; bfloat16 keys of head
size 32 to 128 on AMX tiles where the CPU has them; else its AVX-512 tiles where the CPU has them, the query vectors
in the lanes where a row's heads on their KV head are 16 or a multiple, or 8 or a multiple on a bfloat16 cache or a
float32 latent; as chosen with no AMX tiles in the `no-AMX ms` column; the AVX-512 tiles with the tokens in the lanes
for every item in the `token-lanes ms` column; its portable loops in the `portable ms` column) with
the gather path (KVCacheLayer.gather into reused buffers, then attention_with_lse, PyTorch's flash
kernel) and the plain-matmul reference over the same gathered copy. Reports the median time per
call (the paged and gather+flash samples taken in turn, so that other load falls on both), the KV bytes the call must read (every visible token's K and V, as stored) per second,
and that against the machine's copy bandwidth, measured here as a large tensor copy (bytes
read per second).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_paged_attention.py
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_paged_attention.py --shapes gqa8 --batches 8 --contexts 8192

`--cold POOLS` lets each paged-kernel call read another of POOLS batches' blocks, so that its K/V come from
memory, as an engine's do (a step reads every layer's and every request's cache before a layer's next call);
without it, a case's blocks stay in the caches from call to call.

`--chunks` times a prefill chunk's causal attention to its own K/V instead (chunks of --contexts tokens): the
paged backend's kernel call against PyTorch's flash kernel, for the MLA demo's expanded chunk and the GQA shapes,
and in bfloat16 on a CPU with AMX tiles the kernel's AMX path too; `--over-context C` times the chunk's rows over C
cached keys with no mask (flash against the AMX path).

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_paged_attention.py --chunks --contexts 300 1024 2048
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_paged_attention.py --chunks --chunk-shapes gqa-demo gqa9 \
        --dtypes bf16 --contexts 512 2048 --over-context 4096

The default shapes are gqa8, gqa9 and mla; mla8 (the latent at 8 heads a rank), mla-demo (the MLA demo's
160-channel latent at 8 heads, a TP=2 + DCP=2 rank's) and mla-demo4 (at 4 heads, a TP=2 rank's) are there to be
asked for.

Caches above --max-kv-gib (all requests' K/V in the cache dtype) are skipped, and the reference
above --max-reference-tokens (its scores and gathered float32 copy grow with batch x context).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time

import torch

from kvshard.attention import paged
from kvshard.attention.kernels import (
    AMX_HEAD_SIZES, _flash_attention_with_lse, attention_with_lse, reference_attention_with_lse,
)
from kvshard.kv.cache import GatherBuffers, KVCacheLayer, kv_buffer

# name: (query heads, KV heads, key dim, value dim, value is the key's prefix)
SHAPES = {
    "gqa8": (8, 1, 64, 64, False),  # 8 query heads on 1 KV head, head size 64 (kvshard-demo-gqa)
    "gqa9": (9, 3, 64, 64, False),  # 9 on 3 as SmolLM2-135M
    "gqa-demo": (8, 1, 32, 32, False),  # kvshard-demo-gqa: 8 on 1 at head size 32
    "gqa-llama": (32, 8, 128, 128, False),  # Llama-3-8B's attention on one rank: 32 on 8 at head size 128
    "mla": (16, 1, 576, 512, True),  # MLA absorbed: the latent [c_kv 512 | k_pe 64], V its first 512
    "mla8": (8, 1, 576, 512, True),  # the same latent at 8 query heads a rank (Kimi K2's 64 at tp=8)
    "mla-demo": (8, 1, 160, 128, True),  # kvshard-demo-mla's latent [c_kv 128 | k_pe 32], 8 heads (a DCP rank's)
    "mla-demo4": (4, 1, 160, 128, True),  # the same latent at 4 heads (a TP=2 rank's, without DCP)
}
DEFAULT_SHAPES = ["gqa8", "gqa9", "mla"]
# --chunks: a prefill chunk's causal attention to its own K/V, name: (query heads, KV heads, key dim, value dim)
CHUNK_SHAPES = {
    "mla-expanded": (4, 4, 64, 32),  # the MLA demo's expanded chunk at a rank of tp=2: keys n 32 + r 32, values 32
    "gqa8": (8, 1, 64, 64),
    "gqa9": (9, 3, 64, 64),
    "gqa-demo": (8, 1, 32, 32),  # kvshard-demo-gqa: 8 query heads over 1 KV head of 32 channels
    "gqa-llama": (32, 8, 128, 128),  # Llama-3-8B's attention on one rank: 32 query heads over 8 KV heads of 128
}


def run_chunks(args) -> int:
    """A prefill chunk's causal attention to its own K/V (or, with --over-context C, its rows over C cached keys with
    no mask, as after a gather): the paged kernel's vector loops (paged.causal_attention; chunks only), PyTorch's
    flash kernel, and in bfloat16 at head sizes 32 and 64 on a CPU with AMX tiles the kernel's AMX path
    (paged.amx_attention); median of --repeat, taken in turn. max|do|: the largest output difference from flash."""
    over = args.over_context
    what = f"its rows over {over} cached keys" if over else "a chunk's causal attention to itself"
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; {what}")
    print(f"{'shape':12} {'dtype':5} {'chunk':>6} | {'kernel ms':>9} | {'flash ms':>9} | {'AMX ms':>9} | "
          f"{'flash/kernel':>12} {'flash/AMX':>9} | {'kernel max|do|':>14} {'AMX max|do|':>11}")
    for shape in args.chunk_shapes:
        heads, kv_heads, dk, dv = CHUNK_SHAPES[shape]
        for dname in args.dtypes:
            for length in args.contexts:
                g = torch.Generator().manual_seed(0)
                keys = over or length
                q = torch.randn(length, heads, dk, generator=g).to(DTYPES[dname])
                k, v = (torch.randn(keys, kv_heads, d, generator=g).to(DTYPES[dname]) for d in (dk, dv))
                scale, causal = dk ** -0.5, not over
                runs = {"flash": lambda: _flash_attention_with_lse(q[None], k[None], v[None], None, scale, causal)}
                if causal:
                    runs["kernel"] = lambda: paged.causal_attention(q, k, v, scale)
                if DTYPES[dname] == torch.bfloat16 and dk == dv and dk in AMX_HEAD_SIZES and paged.amx_ready():
                    runs["AMX"] = lambda: paged.amx_attention(q[None], k[None], v[None], scale, causal)
                times = dict(zip(runs, timed_together(list(runs.values()), args.repeat)))
                flash = runs["flash"]()[0][0]
                diffs = {name: float((run()[0].reshape(flash.shape) - flash).abs().max())
                         for name, run in runs.items() if name != "flash"}

                def ms(name):
                    return f"{times[name] * 1e3:9.2f}" if name in times else f"{'-':>9}"

                def ratio(name, width):
                    return f"{times['flash'] / times[name]:{width - 1}.2f}x" if name in times else f"{'-':>{width}}"

                def diff(name, width):
                    return f"{diffs[name]:{width}.1e}" if name in diffs else f"{'-':>{width}}"

                print(f"{shape:12} {dname:5} {length:6} | {ms('kernel')} | {ms('flash')} | {ms('AMX')} | "
                      f"{ratio('kernel', 12)} {ratio('AMX', 9)} | {diff('kernel', 14)} {diff('AMX', 11)}", flush=True)
    return 0


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def timed(fn, repeat: int, min_seconds: float = 0.2) -> float:
    """Median seconds per call over `repeat` samples, each at least a few calls long."""
    return timed_together([fn], repeat, min_seconds)[0]


def timed_together(fns, repeat: int, min_seconds: float = 0.2) -> list[float]:
    """Median seconds per call of each of `fns`, their samples taken in turn (one sample of each,
    then again), so that load from other processes on a shared machine falls on all of them alike."""
    inner = []
    for fn in fns:
        fn()
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-6)
        inner.append(max(1, min(50, int(min_seconds / repeat / once))))
    samples = [[] for _ in fns]
    for _ in range(repeat):
        for fn, n, out in zip(fns, inner, samples):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - start) / n)
    return [statistics.median(x) for x in samples]


def copy_bandwidth(gib: float = 0.5, repeat: int = 5) -> float:
    """Bytes read per second by a large tensor copy (each byte read is also written once)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeat, min_seconds=0.5)
    return src.numel() * 4 / seconds


def setup(shape: str, dtype: torch.dtype, batch: int, context: int, block_size: int, seed: int = 0, rows: int = 1,
          pools: int = 1):
    """One case: `batch` requests of `context` cached tokens, each with `rows` query rows, row r of a request
    seeing its first context - rows + 1 + r tokens (a decode: one row; speculative verification or the rest of a
    prompt after a prefix hit: several). With `pools` > 1 the cache holds that many batches' blocks, and each call
    of the paged kernel reads the next batch's (`next_tables`): cold latents, as in an engine's step, whose other
    layers and requests have been read since a layer's last call."""
    heads, kv_heads, dk, dv, prefix = SHAPES[shape]
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq * pools
    g = torch.Generator().manual_seed(seed)
    # on the pages an engine's cache gets (kv_buffer: transparent huge pages on a CPU unless
    # KVSHARD_KV_HUGE_PAGES=0), which decide how fast cold blocks read
    slots = num_blocks * block_size
    pool = kv_buffer(slots * kv_heads * (dk if prefix else dk + dv) * dtype.itemsize, torch.device("cpu")).view(dtype)
    key = pool[:slots * kv_heads * dk].view(slots, kv_heads, dk).copy_(torch.randn(slots, kv_heads, dk, generator=g))
    value = key[..., :dv] if prefix else pool[slots * kv_heads * dk:].view(slots, kv_heads, dv).copy_(
        torch.randn(slots, kv_heads, dv, generator=g))
    cache = KVCacheLayer(key, value, block_size, dtype)
    pool_tables = torch.randperm(num_blocks, generator=g).view(pools, batch, blocks_per_seq).to(torch.int32)
    tables = pool_tables[0]
    q = torch.randn(batch * rows, heads, dk, generator=g).to(dtype)
    row_seq = torch.arange(batch, dtype=torch.int32).repeat_interleave(rows)
    sees = torch.arange(context - rows + 1, context + 1, dtype=torch.int32)  # row r's visible tokens
    row_lens = sees.repeat(batch)
    span = torch.arange(blocks_per_seq * block_size)
    bias = torch.zeros(batch, rows, span.numel()).masked_fill_((span[None] >= sees[:, None])[None], float("-inf"))
    stored = kv_heads * (dk if prefix else dk + dv) * key.element_size()
    return dict(q=q, rows=rows, cache=cache, tables=tables, pool_tables=pool_tables, calls=0, row_seq=row_seq,
                row_lens=row_lens, bias=bias, scale=1.0 / math.sqrt(dk), kv_bytes=batch * context * stored)


def next_tables(s) -> torch.Tensor:
    """The block table of the next pool's batch (the same batch every call with one pool)."""
    s["calls"] += 1
    return s["pool_tables"][s["calls"] % s["pool_tables"].shape[0]]


def run_paged(s, portable: bool = False, vector_lanes: bool = True, tables: torch.Tensor | None = None,
              amx_tiles: bool | None = None):
    c = s["cache"]
    return paged.paged_attention(s["q"], c.key, c.value, next_tables(s) if tables is None else tables, s["row_seq"],
                                 s["row_lens"], c.block_size, s["scale"], use_kernel=True, portable=portable,
                                 vector_lanes=vector_lanes, amx_tiles=amx_tiles)


def run_gather_flash(s, buffers):
    keys, values = s["cache"].gather(s["tables"].long(), buffers)
    return attention_with_lse(_by_request(s), keys, values, s["bias"], s["scale"])


def run_reference(s, buffers):
    keys, values = s["cache"].gather(s["tables"].long(), buffers)
    return reference_attention_with_lse(_by_request(s), keys, values, s["bias"], s["scale"])


def _by_request(s) -> torch.Tensor:
    q = s["q"]
    return q.view(-1, s["rows"], *q.shape[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768])
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1, help="query rows per request (1: decodes), each seeing up to "
                        "its own position")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-kv-gib", type=float, default=2.0)
    parser.add_argument("--cold", type=int, default=1, metavar="POOLS",
                        help="hold POOLS batches' blocks and let each paged-kernel call read the next batch's: the "
                        "latents come from memory, as in an engine's step (the gather and reference paths keep one)")
    parser.add_argument("--max-reference-tokens", type=int, default=64 * 8192)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--over-context", type=int, default=0, metavar="C",
                        help="with --chunks: the chunk's rows over C cached keys with no mask, not causal")
    parser.add_argument("--chunks", action="store_true", help="time a prefill chunk's causal attention to itself "
                        "instead (the kernel against PyTorch's flash), chunks of --contexts tokens")
    parser.add_argument("--chunk-shapes", nargs="+", default=list(CHUNK_SHAPES), choices=list(CHUNK_SHAPES))
    args = parser.parse_args(argv)
    if args.chunks:
        if not paged.kernel_available():
            print("the paged attention kernel could not be built; nothing to compare", file=sys.stderr)
            return 1
        return run_chunks(args)

    if not paged.kernel_available():
        print("the paged attention kernel could not be built; nothing to compare", file=sys.stderr)
        return 1
    bandwidth = copy_bandwidth()
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads; copy bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"(bytes read per second by a 0.5 GiB tensor copy)")
    print(f"{'shape':5} {'dtype':5} {'batch':>5} {'context':>7} {'KV MB':>8} | {'paged ms':>9} {'GB/s':>6} {'%copy':>6}"
          f" | {'no-AMX ms':>9} | {'token-lanes ms':>14} | {'portable ms':>11} | {'gather+flash ms':>15} {'GB/s':>6}"
          f" | {'reference ms':>12} | {'speedup':>7}"
          f" {'max|do|':>8}")
    rows = []
    for shape in args.shapes:
        for dname in args.dtypes:
            for batch in args.batches:
                for context in args.contexts:
                    heads, kv_heads, dk, dv, prefix = SHAPES[shape]
                    stored = kv_heads * (dk if prefix else dk + dv) * DTYPES[dname].itemsize
                    if batch * context * stored * args.cold > args.max_kv_gib * (1 << 30):
                        print(f"{shape:5} {dname:5} {batch:5} {context:7} skipped: cache above {args.max_kv_gib} GiB")
                        continue
                    s = setup(shape, DTYPES[dname], batch, context, args.block_size, rows=args.rows,
                              pools=args.cold)
                    buffers = GatherBuffers()  # reused across calls, as the layers of a step do
                    t_paged, t_vector, t_tokens, t_portable, t_flash = timed_together(
                        [lambda: run_paged(s), lambda: run_paged(s, amx_tiles=False),
                         lambda: run_paged(s, vector_lanes=False, amx_tiles=False),
                         lambda: run_paged(s, portable=True), lambda: run_gather_flash(s, buffers)], args.repeat)
                    o_p, _ = run_paged(s, tables=s["tables"])
                    o_f, _ = run_gather_flash(s, buffers)
                    diff = float((o_p - o_f.flatten(0, 1)).abs().max())
                    t_ref = None
                    if batch * context <= args.max_reference_tokens:
                        t_ref = timed(lambda: run_reference(s, buffers), max(1, args.repeat // 2))
                    del buffers
                    row = dict(shape=shape, dtype=dname, batch=batch, context=context, kv_bytes=s["kv_bytes"],
                               paged_s=t_paged, no_amx_s=t_vector, token_lanes_s=t_tokens, portable_s=t_portable,
                               gather_flash_s=t_flash, reference_s=t_ref,
                               paged_gbps=s["kv_bytes"] / t_paged / 1e9, flash_gbps=s["kv_bytes"] / t_flash / 1e9,
                               copy_gbps=bandwidth / 1e9, max_abs_diff=diff)
                    rows.append(row)
                    ref = f"{t_ref * 1e3:12.2f}" if t_ref is not None else f"{'-':>12}"
                    print(f"{shape:5} {dname:5} {batch:5} {context:7} {s['kv_bytes'] / 1e6:8.1f} | "
                          f"{t_paged * 1e3:9.2f} {row['paged_gbps']:6.1f} {100 * s['kv_bytes'] / t_paged / bandwidth:5.0f}%"
                          f" | {t_vector * 1e3:9.2f} | {t_tokens * 1e3:14.2f} | {t_portable * 1e3:11.2f}"
                          f" | {t_flash * 1e3:15.2f}"
                          f" {row['flash_gbps']:6.1f} | {ref} | "
                          f"{t_flash / t_paged:6.2f}x {diff:8.1e}", flush=True)
                    del s
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_model(), threads=torch.get_num_threads(), copy_gbps=bandwidth / 1e9, rows=rows), f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
