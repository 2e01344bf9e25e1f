"""MLA's two forms of reading cached context for a long chunk: absorbed against expanded (docs/mla.md).

`layer`: one layer's attention of R rows of one request over L cached latents, as the paged backend runs it on
this CPU. Absorbed: the kernel over the latents with queries of c + r channels. Expanded: the latents through
the whole `kv_b_proj` slice in one product, the keys' copy ([k_nope | k_pe] per head), then the kernel with keys
of n + r and values of v channels. Median of --repeat calls each; the ratio is absorbed time over expanded.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_mla_context_forms.py layer --threads 1 2
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_mla_context_forms.py layer --dims deepseek-v3 --dtype bfloat16 \\
        --tokens 2048 --rows 128 192 256 384 512

`turn`: an agent's new turn through an engine. A prompt of --cached tokens is prefilled once (prefix caching on),
then prompts of those tokens and R new ones, one at a time, `max_tokens=1`: the time of each is the new turn's
prefill over its cached conversation. The engine reads the form's bound from the environment, so run it once
with KVSHARD_MLA_EXPANDED_MIN_ROWS=1000000 (absorbed) and once without, in turn:

    KVSHARD_MLA_EXPANDED_MIN_ROWS=1000000 PYTHONPATH=$PWD .venv/bin/python scripts/bench_mla_context_forms.py turn \\
        -tp 2 --dcp 2 --cached 8192 --rows 32 96 128 512
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_mla_context_forms.py turn -tp 2 --dcp 2 --cached 8192 \\
        --rows 32 96 128 512
"""

from __future__ import annotations

import argparse
import random
import time

import torch

# (heads, c, r, n, v): the MLA demo at one rank's 8 heads, DeepSeek-V3 at 16 heads a rank (128 heads at tp=8)
DIMS = {"demo": (8, 128, 32, 32, 32), "deepseek-v3": (16, 512, 64, 128, 128)}


def _median_ms(call, repeat: int) -> float:
    for _ in range(2):
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeat // 2] * 1e3


def layer(args) -> None:
    from types import SimpleNamespace

    from kvshard.attention import backend, paged
    from kvshard.attention.backends import PagedBackend
    from kvshard.engine.process_setup import keep_freed_memory

    keep_freed_memory()  # as every rank does: the pieces' keys and values reuse memory instead of fresh pages

    heads, c, r, n, v = DIMS[args.dims]
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(heads * (n + v), c, generator=generator) * 0.05).to(dtype)  # [W_UK; W_UV] of the heads
    latents = torch.randn(args.tokens, c + r, generator=generator).to(dtype)
    cache = latents.unsqueeze(1).contiguous()  # [L, 1, c + r]: one block holding the request's latents
    table, one = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(max(args.rows), dtype=torch.int32)

    def keys_values(x):  # as DeepseekV2MLAAttention's: one product with the slice, then the keys' copy
        both = torch.nn.functional.linear(x[:, :c], weight)
        k_nope = both[:, :heads * n].unflatten(1, (heads, n))
        return torch.cat([k_nope, x[:, c:].unsqueeze(1).expand(-1, heads, -1)], dim=-1), \
            both[:, heads * n:].unflatten(1, (heads, v))

    # the engine's own loop over pieces (Attention._expanded_attention), the paged backend's kernel
    form = backend.ExpandedContext(1, v, None, keys_values)
    piece_bytes = args.piece_bytes or backend.EXPANDED_PIECE_BYTES
    layer_ = SimpleNamespace(scale=0.1, expanded_piece_bytes=piece_bytes)
    meta = SimpleNamespace(backend=PagedBackend())

    piece = max(args.block_size, piece_bytes // (heads * (n + r + v) * latents.element_size())
                // args.block_size * args.block_size)

    def expanded(q):
        pieces = (latents[first:first + piece] for first in range(0, args.tokens, piece))
        return backend.Attention._expanded_attention(layer_, q, pieces, form, meta)

    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}; {args.dims} dims: {heads} heads, c {c}, r {r}, n {n}, "
          f"v {v}; {args.tokens} cached tokens, {args.dtype}; expanded in pieces of {min(piece, args.tokens)} tokens")
    print("threads  rows  absorbed ms  expanded ms  absorbed / expanded")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            q_expanded = torch.randn(rows, heads, n + r, generator=generator).to(dtype)
            q_absorbed = torch.randn(rows, heads, c + r, generator=generator).to(dtype)
            lens = torch.full((rows,), args.tokens, dtype=torch.int32)

            def absorbed():
                return paged.paged_attention(q_absorbed, cache, cache[..., :c], table, one[:rows], lens, args.tokens,
                                             0.1, use_kernel=True)

            e = _median_ms(lambda: expanded(q_expanded), args.repeat)
            a = _median_ms(absorbed, args.repeat)
            print(f"{threads:7d}  {rows:4d}  {a:11.2f}  {e:11.2f}  {a / e:.2f}x", flush=True)


def turn(args) -> None:
    from kvshard import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0)
    with LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size,
             decode_context_parallel_size=args.dcp, dcp_attention_layout=args.dcp_attention_layout,
             kv_cache_memory=args.kv_cache_memory, max_model_len=args.cached + max(args.rows) + 16,
             enable_prefix_caching=True) as llm:
        prefix = [rng.randrange(5, args.vocab_size) for _ in range(args.cached)]
        llm.generate([prefix], params, use_tqdm=False)
        print(f"{args.model} tp={args.tensor_parallel_size} dcp={args.dcp} ({args.dcp_attention_layout}); "
              f"{args.cached} cached tokens; the expanded form's bound: KVSHARD_MLA_EXPANDED_MIN_ROWS or the model's")
        for rows in args.rows:
            times = []
            for _ in range(args.repeat):
                prompt = prefix + [rng.randrange(5, args.vocab_size) for _ in range(rows)]
                start = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            times.sort()
            print(f"{rows} new tokens: median {times[len(times) // 2] * 1e3:.1f} ms, best {times[0] * 1e3:.1f} ms",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("layer", help="one layer's two forms, the kernel in both")
    p.add_argument("--dims", choices=sorted(DIMS), default="demo")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--tokens", type=int, default=4096, help="cached tokens of the request")
    p.add_argument("--rows", type=int, nargs="+", default=[48, 64, 80, 96, 128])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--block-size", type=int, default=16, help="the pieces are whole blocks of this many tokens")
    p.add_argument("--piece-bytes", type=int, default=0,
                   help="the pieces' bound on keys and values (KVSHARD_MLA_EXPANDED_PIECE_BYTES; 0: its default)")
    p.set_defaults(run=layer)
    p = sub.add_parser("turn", help="a new turn's prefill over a cached conversation, through an engine")
    p.add_argument("model", nargs="?", default="kvshard-demo")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--dcp-attention-layout", default="auto", choices=["auto", "head-split", "replicated"])
    p.add_argument("--cached", type=int, default=8192, help="tokens of the cached conversation")
    p.add_argument("--rows", type=int, nargs="+", default=[32, 96, 128, 512], help="new tokens of the turn")
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--vocab-size", type=int, default=512, help="token ids are drawn below it (the demos': 512)")
    p.add_argument("--repeat", type=int, default=7)
    p.set_defaults(run=turn)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
