"""One prepared check of kvshard's GPU path on a machine with one NVIDIA GPU (scripts/device_check.sh).

Sections, each recorded in one JSON file (--out) with its figures and whether it passed:

1. `kernels`: the Triton paged attention (attention/triton_paged.py) on the device against the
   plain-matmul reference on the same device: GQA head groups (8 on 1, 9 on 3), MLA's latent,
   block sizes 16 and 64, DCP interleaves 1 and 16 with a rank that holds none of a short request
   (LSE -inf), several rows per request (verification), bfloat16 and FP8 e4m3 caches; and a
   chunk's causal attention with its LSE (attention/kernels.py) against the reference.
2. `bandwidth`: the kernel's time on decode batches and the KV bytes it reads per second, against
   the device's copy bandwidth measured here (a large device-to-device copy).
3. `tests`: the suite's kernel and engine files that run on the device (pytest), their counts.

`--dry-run` runs all of it on the CPU (the kernels under Triton's interpreter, small shapes, the
tests' CPU subset) so the script's own bugs are found without a GPU; its figures mean nothing.
Nothing is downloaded: the tests use the models the suite builds or finds in the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU, small shapes")
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--sections", nargs="+", default=["kernels", "bandwidth", "tests"],
                        choices=["kernels", "bandwidth", "tests"])
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds for the pytest section")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check: no CUDA device (run with --dry-run to check the script on a CPU)", file=sys.stderr)
        return 2
    result: dict = {"machine": _machine(torch, device), "dry_run": args.dry_run, "sections": {}}
    ok = True
    for name in args.sections:
        started = time.perf_counter()
        print(f"device_check: {name} ...", flush=True)
        try:
            section = {"kernels": check_kernels, "bandwidth": measure_bandwidth,
                       "tests": run_tests}[name](torch, device, args)
        except Exception as exc:  # noqa: BLE001 - a section that breaks is recorded, the others still run
            section = {"passed": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        section["seconds"] = round(time.perf_counter() - started, 1)
        result["sections"][name] = section
        ok &= bool(section.get("passed", True))
        print(f"device_check: {name}: {'passed' if section.get('passed', True) else 'FAILED'} "
              f"in {section['seconds']} s", flush=True)
    result["passed"] = ok
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"device_check: wrote {args.out}; {'all passed' if ok else 'something FAILED'}")
    return 0 if ok else 1


def _machine(torch, device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device.type,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda, sms=props.multi_processor_count)
    else:
        info["cpu"] = platform.processor() or platform.machine()
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def _case(torch, device, *, heads, kv_heads, dk, dv, mla, block_size, interleave, dcp, rank, context_lens,
          query_lens, cache_dtype, seed=0):
    """Random cache, shuffled block tables and the rows a DCP rank sees; the reference on the device."""
    from kvshard.attention import paged
    from kvshard.attention.kernels import reference_attention_with_lse
    from kvshard.kv.cache import FP8_DTYPE, FP8_MAX
    from kvshard.kv.layout import DCPLayout

    layout = DCPLayout(block_size, dcp, interleave)
    local_max = max(layout.local_len(c, rank) for c in context_lens)
    max_blocks = max(1, -(-local_max // block_size)) + 1
    num_blocks = len(context_lens) * max_blocks + 3
    g = torch.Generator().manual_seed(seed)
    slots = num_blocks * block_size
    k_scale, v_scale = (0.05, 0.02) if cache_dtype == FP8_DTYPE else (1.0, 1.0)
    real_k = torch.randn(slots, kv_heads, dk, generator=g)
    real_v = None if mla else torch.randn(slots, kv_heads, dv, generator=g)

    def store(x, scale):
        if cache_dtype == FP8_DTYPE:
            return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return x.to(cache_dtype)

    key = store(real_k, k_scale).to(device)
    value = key[..., :dv] if mla else store(real_v, v_scale).to(device)
    value_scale = k_scale if mla else v_scale
    key_f, value_f = key.float() * k_scale, value.float() * value_scale
    tables = torch.randperm(num_blocks, generator=g)[: len(context_lens) * max_blocks]
    tables = tables.view(len(context_lens), max_blocks).to(torch.int32)
    row_seq, row_lens = paged.row_lens_of(context_lens, query_lens, layout, rank)
    compute = torch.float32 if cache_dtype in (torch.float32, FP8_DTYPE) else cache_dtype
    q = torch.randn(int(row_seq.numel()), heads, dk, generator=g).to(compute).to(device)
    scale = 1.0 / math.sqrt(dk)
    out = torch.zeros(q.shape[0], heads, dv, device=device)
    lse = torch.full((q.shape[0], heads), float("-inf"), device=device)
    for r in range(q.shape[0]):
        n = int(row_lens[r])
        if n:
            j = torch.arange(n)
            s = (tables[int(row_seq[r])].long()[j // block_size] * block_size + j % block_size).to(device)
            o, l = reference_attention_with_lse(q[r:r + 1].float()[None], key_f[s][None], value_f[s][None],
                                                torch.zeros(1, 1, n, device=device), scale)
            out[r], lse[r] = o[0, 0], l[0, 0]
    return dict(q=q, key=key, value=value, tables=tables, row_seq=row_seq, row_lens=row_lens,
                block_size=block_size, scale=scale, k_scale=k_scale, v_scale=value_scale, ref=(out, lse))


def _error(torch, got, want) -> tuple[float, bool]:
    """Largest absolute difference of (o, lse) and whether the -inf rows agree."""
    (o, l), (ro, rl) = got, want
    empty = torch.isneginf(rl)
    same_empty = bool(torch.equal(torch.isneginf(l), empty)) and bool(torch.all(o[empty] == 0))
    finite = ~empty
    err = max(float((o - ro).abs().max()) if o.numel() else 0.0,
              float((l[finite] - rl[finite]).abs().max()) if finite.any() else 0.0)
    return err, same_empty


def check_kernels(torch, device, args) -> dict:
    from kvshard.attention import triton_paged
    from kvshard.attention.kernels import attention_with_lse, reference_attention_with_lse
    from kvshard.kv.cache import FP8_DTYPE

    why = triton_paged.available()
    if why is not None:
        return {"passed": False, "error": why}
    small = args.dry_run
    cases = []
    for heads, kv_heads, dk, dv, mla in [(8, 1, 64, 64, False), (9, 3, 64, 64, False),
                                         (16, 1, 72 if small else 576, 64 if small else 512, True)]:
        for cache_dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (FP8_DTYPE, 1e-3)]:
            for block_size, interleave, dcp, rank in [(16, 1, 2, 1), (64, 16, 2, 1)]:
                lens = [1, 5, 37, 90] if small else [1, 5, 37, 300, 2000]
                queries = [1, 1, 3, 1] if small else [1, 1, 3, 1, 4]
                cases.append(dict(heads=heads, kv_heads=kv_heads, dk=dk, dv=dv, mla=mla, block_size=block_size,
                                  interleave=interleave, dcp=dcp, rank=rank, context_lens=lens,
                                  query_lens=queries, cache_dtype=cache_dtype, tol=tol))
    rows, passed = [], True
    for i, case in enumerate(cases):
        tol = case.pop("tol")
        c = _case(torch, device, seed=i, **case)
        got = triton_paged.triton_paged_attention(c["q"], c["key"], c["value"], c["tables"], c["row_seq"],
                                                  c["row_lens"], c["block_size"], c["scale"], c["k_scale"],
                                                  c["v_scale"])
        err, same_empty = _error(torch, got, c["ref"])
        good = same_empty and err <= tol
        passed &= good
        rows.append({**{k: str(v) if k == "cache_dtype" else v for k, v in case.items()}, "max_error": err,
                     "empty_rows_agree": same_empty, "passed": good})
    # a chunk's own causal attention with its LSE
    g = torch.Generator().manual_seed(99)
    for dtype, tol in [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)]:
        q = torch.randn(2, 33, 8, 64, generator=g).to(dtype).to(device)
        k = torch.randn(2, 33, 2, 64, generator=g).to(dtype).to(device)
        v = torch.randn(2, 33, 2, 64, generator=g).to(dtype).to(device)
        got = attention_with_lse(q, k, v, None, 0.125, causal=True)
        bias = torch.full((33, 33), float("-inf"), device=device).triu_(1)[None]
        want = reference_attention_with_lse(q.float(), k.float(), v.float(), bias, 0.125)
        err = max(float((got[0] - want[0]).abs().max()), float((got[1] - want[1]).abs().max()))
        passed &= err <= tol
        rows.append({"chunk_causal": str(dtype), "max_error": err, "passed": err <= tol})
    return {"passed": passed, "cases": rows}


def measure_bandwidth(torch, device, args) -> dict:
    from kvshard.attention import triton_paged
    from kvshard.attention.paged import row_lens_of
    from kvshard.kv.layout import DCPLayout

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn, repeat=5):
        fn()
        sync()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return sorted(samples)[len(samples) // 2]

    big = torch.empty((1 << 22) if args.dry_run else (1 << 30), dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    copy_s = timed(lambda: dst.copy_(big))
    copy_bw = big.numel() / copy_s
    del big, dst
    rows = []
    shapes = {"gqa8": (8, 1, 64, 64, False), "gqa9": (9, 3, 64, 64, False), "mla": (16, 1, 576, 512, True)}
    grid = [(1, 256)] if args.dry_run else [(b, c) for b in (1, 8, 64) for c in (1024, 8192, 32768)]
    for name, (heads, kv_heads, dk, dv, mla) in shapes.items():
        if args.dry_run and name == "mla":
            continue
        for batch, context in grid:
            block = 16
            blocks_per = -(-context // block)
            num_blocks = batch * blocks_per
            key = torch.randn(num_blocks * block, kv_heads, dk, device=device).to(torch.bfloat16)
            value = key[..., :dv] if mla else torch.randn(num_blocks * block, kv_heads, dv, device=device).to(
                torch.bfloat16)
            tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per).to(torch.int32)
            row_seq, row_lens = row_lens_of([context] * batch, [1] * batch, DCPLayout(block, 1, 1), 0)
            q = torch.randn(batch, heads, dk, device=device).to(torch.bfloat16)
            seconds = timed(lambda: triton_paged.triton_paged_attention(q, key, value, tables, row_seq, row_lens,
                                                                        block, 0.125), repeat=3)
            kv_bytes = batch * context * kv_heads * (dk if mla else dk + dv) * 2
            rows.append({"shape": name, "batch": batch, "context": context, "ms": round(seconds * 1e3, 3),
                         "kv_gib_per_s": round(kv_bytes / seconds / 2**30, 1),
                         "of_copy_bandwidth": round(kv_bytes / seconds / copy_bw, 3)})
            del key, value
    return {"passed": True, "copy_gib_per_s": round(copy_bw / 2**30, 1), "rows": rows}


def run_tests(torch, device, args) -> dict:
    files = ["tests/test_triton_attention.py", "tests/test_merge.py"]
    if not args.dry_run:
        files += ["tests/test_generate.py"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["TRITON_INTERPRET"] = "1"  # test_triton_attention checks the kernels on CPU tensors, interpreted
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=args.test_timeout)
    except subprocess.TimeoutExpired:
        return {"passed": False, "files": files, "error": f"pytest ran past {args.test_timeout} s"}
    tail = proc.stdout.strip().splitlines()[-1:] or [""]
    return {"passed": proc.returncode == 0, "files": files, "summary": tail[0],
            "failures": [line for line in proc.stdout.splitlines() if line.startswith("FAILED")][:20]}


if __name__ == "__main__":
    sys.exit(main())
