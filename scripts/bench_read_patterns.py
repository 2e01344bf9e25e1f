"""How fast this machine's cores read memory in the patterns a decode step reads it: chunks of a given size in
random order (a paged KV cache's blocks), each read front to back, with or without software prefetches.

A decode step's attention reads every request's blocks where the block table puts them; a block of SmolLM2's keys
(16 tokens x 3 KV heads x 64 channels, bfloat16) is 6 KiB, and its values another 6 KiB elsewhere. The hardware's
prefetchers follow a run of lines within a page but not a jump to another block, so the paged kernel prefetches each
tile's lines itself, and a core has only so many misses in flight. This measures the read rate of such patterns on
both threads (OpenMP, as torch's), from a buffer on huge pages where the system gives them (kvshard/host_pages.py):

    plain           each chunk read front to back, nothing prefetched
    prefetch-all    as plain, with every line of the chunk two ahead prefetched into L2 first (the kernel's way)
    prefetch-start  as plain, with the first two lines of the chunk two ahead prefetched into L2

and, for reference, torch's sum over the whole buffer (one sequential run). The C++ is built on first use with
torch's cpp_extension into kvshard's kernel cache directory.

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_read_patterns.py
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_read_patterns.py --chunks 6144 49152 --gib 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench_paged_attention import cpu_model  # this folder's

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>

// Best seconds of `repeats` passes over chunks [order] of `chunk` bytes of buf, each thread a contiguous share of
// the order; mode 0 plain, 1 every line of the chunk two ahead prefetched (T1), 2 its first two lines.
double read_rate(const torch::Tensor& buf, int64_t chunk, const torch::Tensor& order, int64_t mode, int64_t repeats,
                 int64_t threads) {
  const char* base = reinterpret_cast<const char*>(buf.data_ptr());
  const int64_t* ord = order.data_ptr<int64_t>();
  const int64_t n = order.numel();
  double best = 1e30;
  float sink = 0.0f;
  for (int64_t rep = 0; rep < repeats; ++rep) {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = lo; i < hi; ++i) {
        if (mode != 0 && i + 2 < hi) {
          const char* p = base + ord[i + 2] * chunk;
          const int64_t lines = mode == 1 ? chunk / 64 : 2;
          for (int64_t b = 0; b < lines; ++b) _mm_prefetch(p + b * 64, _MM_HINT_T1);
        }
        const char* p = base + ord[i] * chunk;
        for (int64_t b = 0; b < chunk; b += 64) acc = _mm512_add_ps(acc, _mm512_loadu_ps(reinterpret_cast<const float*>(p + b)));
      }
      sink += _mm512_reduce_add_ps(acc);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s < best) best = s;
  }
  if (sink == 0.5f) best += 1e-12;  // the sums are used: the loads stay
  return best;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("read_rate", &read_rate); }
"""

MODES = {"plain": 0, "prefetch-all": 1, "prefetch-start": 2}


def build():
    from torch.utils.cpp_extension import load_inline

    from kvshard.attention import paged

    paged._ninja_on_path()
    directory = paged.kernel_cache_dir() / "read_patterns"
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline("kvshard_read_patterns", cpp_sources=[SOURCE], extra_cflags=["-O2", "-march=native", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="the buffer read (well above the caches)")
    parser.add_argument("--chunks", nargs="+", type=int, default=[6144, 12288, 24576, 49152, 98304, 393216])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if any(c % 64 for c in args.chunks):
        parser.error("--chunks: multiples of 64 bytes")
    if "avx512f" not in Path("/proc/cpuinfo").read_text():
        print("this script's loops need AVX-512", file=sys.stderr)
        return 1

    from kvshard import host_pages

    module = build()
    threads = torch.get_num_threads()
    size = int(args.gib * 2**30) // max(args.chunks) * max(args.chunks)
    huge = host_pages.huge_pages_here(torch.device("cpu"))
    buf = host_pages.huge_page_buffer(size) if huge else torch.empty(size, dtype=torch.uint8)
    buf.view(torch.float32).fill_(1.0)
    floats = buf.view(torch.float32)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        floats.sum()
        best = min(best, time.perf_counter() - start)
    print(f"CPU: {cpu_model()}, {threads} threads; {size / 2**30:.2f} GiB on "
          f"{'huge pages' if huge else 'the allocator pages'}")
    print(f"torch sum over the whole buffer (one sequential run): {size / best / 1e9:.1f} GB/s")
    print(f"{'chunk':>8} | " + " | ".join(f"{name:>14}" for name in MODES) + "   (GB/s, chunks in random order)")
    generator = torch.Generator().manual_seed(0)
    for chunk in args.chunks:
        order = torch.randperm(size // chunk, generator=generator)
        rates = [size // chunk * chunk / module.read_rate(buf, chunk, order, mode, args.repeats, threads) / 1e9
                 for mode in MODES.values()]
        print(f"{chunk:>8} | " + " | ".join(f"{r:>14.1f}" for r in rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
