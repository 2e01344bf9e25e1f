"""One prepared check of kvshard's GPU path on a machine with one NVIDIA GPU (scripts/device_check.sh).

Sections, each recorded in one JSON file (--out) with its figures and whether it passed:

1. `kernels`: the Triton paged attention (attention/triton_paged.py) on the device against the
   plain-matmul reference on the same device: GQA head groups (8 on 1, 9 on 3), MLA's latent,
   block sizes 16 and 64, DCP interleaves 1 and 16 with a rank that holds none of a short request
   (LSE -inf), several rows per request (verification), bfloat16 and FP8 e4m3 caches; a chunk's
   causal attention with its LSE (attention/kernels.py) against the reference; and a long context
   with a bias as the gather backend attends it (tile by tile over the keys on a GPU).
2. `bandwidth`: the kernel's time on decode batches and the KV bytes it reads per second, against
   the device's copy bandwidth measured here (a large device-to-device copy).
3. `graphs`: decode steps replayed as CUDA graphs (engine/cuda_graphs.py) against the same steps run
   eagerly on a tiny random Llama: batches of 1, 3 and 8 (padded to 1, 4 and 8), their logits' largest
   difference and each path's time per step.
4. `e2e`: the whole model through the Triton backend against transformers on the same weights (greedy
   tokens and logprobs; a tiny random Llama with GQA): one rank with its decode graphs, the same with
   `enforce_eager`, and tp=2 dcp=2 as two ranks sharing the one GPU (their collectives on gloo).
5. `floor`: a decode step of a random Llama (bfloat16, GQA; about 0.3 B parameters on a GPU) at 32
   requests of 1,024 tokens against its memory-bandwidth floor (weights + KV read once, at the
   device's copy bandwidth: `kvshard bench decode-floor`'s measure), with its decode graphs and with
   `enforce_eager`.
6. `tests`: the suite's kernel and engine files that run on the device (pytest), their counts.

`--dry-run` runs all of it on the CPU (the kernels under Triton's interpreter, small shapes, the
graphs replaced by a stand-in that re-runs the step, the tests' CPU subset) so the script's own bugs
are found without a GPU; its figures mean nothing.
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
SECTIONS = ["kernels", "bandwidth", "graphs", "e2e", "floor", "tests"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything on the CPU, small shapes")
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
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
            section = {"kernels": check_kernels, "bandwidth": measure_bandwidth, "graphs": check_graphs,
                       "e2e": check_end_to_end, "floor": measure_floor,
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
    # attention over cached context with a bias where the Triton backend is not used (the gather backend):
    # tile by tile over the keys on a GPU (kernels.tiled_attention_with_lse), a decode of a long context
    length = 600 if small else 5000
    q = torch.randn(2, 1, 8, 64, generator=g).to(device)
    k = torch.randn(2, length, 1, 64, generator=g).to(device)
    v = torch.randn(2, length, 1, 64, generator=g).to(device)
    bias = torch.zeros(2, 1, length, device=device)
    bias[1, :, length // 3:] = float("-inf")
    got = attention_with_lse(q, k, v, bias, 0.125)
    want = reference_attention_with_lse(q, k, v, bias, 0.125)
    err = max(float((got[0] - want[0]).abs().max()), float((got[1] - want[1]).abs().max()))
    passed &= err <= 1e-4
    rows.append({"context_with_bias": length, "max_error": err, "passed": err <= 1e-4})
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


def _tiny_llama(directory: Path) -> Path:
    """The suite's tiny random Llama (GQA: 4 query heads on 1 KV head), written with transformers."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_hf_checkpoint, tiny_llama_config

    return save_hf_checkpoint(tiny_llama_config(), directory)


def check_graphs(torch, device, args) -> dict:
    import tempfile

    from kvshard.engine import cuda_graphs
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.model_runner import ModelRunner
    from kvshard.engine.step_plan import StepPlan
    from kvshard.kv.cache import allocate_kv_cache
    from kvshard.parallel import single_rank_state

    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_llama(Path(tmp) / "llama")
        config = EngineArgs(model=str(path), attention_backend="triton", max_model_len=128, num_kv_blocks=64,
                            max_num_seqs=8, block_size=16).create_engine_config()
        runner = ModelRunner(config, single_rank_state(), device)
        if device.type == "cuda":
            graphed = runner.decode_graphs
            if graphed is None:
                return {"passed": False, "error": "the runner captured no decode graphs: "
                        + str(cuda_graphs.graphs_unavailable(config, device.type))}
        else:  # the stand-in graphs on the CPU, over a cache with the scratch block, as on CUDA
            runner.kv_caches = allocate_kv_cache(config.kv_cache_spec, config.num_kv_blocks + 1, 16,
                                                 config.model.dtype, device)
            graphed = cuda_graphs.GraphedDecode(runner, cuda_graphs.RerunGraphApi())
            if not graphed.capture():
                return {"passed": False, "error": "capture failed (see the log)"}
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        lengths = [5, 40, 17, 1, 70, 9, 33, 64]
        tables = [[8 * i + j for j in range(8)] for i in range(len(lengths))]
        prompts = [[(3 * i + 7 * j) % 120 + 1 for j in range(n)] for i, n in enumerate(lengths)]
        rows, passed = [], True
        with torch.inference_mode():
            runner.execute(StepPlan([t for p in prompts for t in p], lengths, [0] * len(lengths), tables,
                                    [sum(lengths[:i + 1]) - 1 for i in range(len(lengths))]))
            for batch in (1, 3, 8):
                plan = StepPlan([11] * batch, [1] * batch, lengths[:batch], tables[:batch], list(range(batch)))
                times = {}
                for name in ("graph", "eager"):
                    samples = []
                    for _ in range(3 if args.dry_run else 20):
                        sync()
                        start = time.perf_counter()
                        if name == "graph":
                            replayed, logits = graphed.execute(plan)
                            if not replayed:
                                return {"passed": False, "error": f"a batch of {batch} decodes was not replayed"}
                        else:
                            logits = runner.execute(plan) if device.type != "cuda" else _eager(runner, plan)
                        sync()
                        samples.append(time.perf_counter() - start)
                    times[name] = (sorted(samples)[len(samples) // 2], logits.float().clone())
                err = float((times["graph"][1] - times["eager"][1]).abs().max())
                good = err <= 1e-4
                passed &= good
                rows.append({"batch": batch, "graph_size": graphed.graphs.size_for(batch), "max_logit_error": err,
                             "graph_ms": round(times["graph"][0] * 1e3, 3),
                             "eager_ms": round(times["eager"][0] * 1e3, 3), "passed": good})
        return {"passed": passed, "captured_sizes": sorted(graphed.graphs.graphs), "rows": rows,
                "replays": graphed.graphs.replays}


def _eager(runner, plan):
    """The step without its graph (the runner's own eager path)."""
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        return runner.execute(plan)
    finally:
        runner.decode_graphs = graphs


def check_end_to_end(torch, device, args) -> dict:
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import hf_greedy_with_logprobs

    from kvshard import LLM, SamplingParams

    prompts = [[3, 1, 4], [(7 * i) % 97 + 1 for i in range(21)]]
    new_tokens = 4 if args.dry_run else 16
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=3)
    layouts = [("tp1 graphs", dict()), ("tp1 eager", dict(enforce_eager=True)),
               ("tp2 dcp2 one device", dict(tensor_parallel_size=2, decode_context_parallel_size=2))]
    rows, passed = [], True
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_llama(Path(tmp) / "llama")
        want_tokens, want_steps = hf_greedy_with_logprobs(path, prompts, new_tokens)
        for name, layout in layouts:
            row = {"layout": name}
            try:
                with LLM(str(path), attention_backend="triton", block_size=16, max_model_len=64, num_kv_blocks=32,
                         max_num_seqs=4, max_num_batched_tokens=12, **layout) as llm:
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    graphs = llm.engine.runner.decode_graphs
                    row["graph_replays"] = graphs.graphs.replays if graphs is not None else 0
                tokens = [o.outputs[0].token_ids for o in outs]
                err = max(abs(lp - float(want_steps[p][s][tok])) for p, o in enumerate(outs)
                          for s, step in enumerate(o.outputs[0].logprobs) for tok, lp in step.items())
                good = tokens == want_tokens and err <= 1e-3
                row.update(same_tokens=tokens == want_tokens, max_logprob_error=err, passed=good)
            except Exception as exc:  # noqa: BLE001 - a layout that breaks is recorded, the others still run
                row.update(passed=False, error=f"{type(exc).__name__}: {exc}")
            passed &= row["passed"]
            rows.append(row)
    if device.type == "cuda":  # the one-rank engine with graphs must have replayed them
        passed &= rows[0].get("graph_replays", 0) > 0
    return {"passed": passed, "rows": rows}


def measure_floor(torch, device, args) -> dict:
    import tempfile

    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import save_hf_checkpoint, tiny_llama_config

    from kvshard.bench.decode_floor import measure_decode_floor
    from kvshard.engine.arg_utils import EngineArgs

    if args.dry_run:
        size, batch, context, steps = dict(), 4, 64, 3
    else:  # ~0.3 B parameters: 4 layers of hidden 2048 (16 query heads on 4 KV heads), a 32K vocabulary
        size = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
                    initializer_range=0.02)
        batch, context, steps = 32, 1024, 20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_hf_checkpoint(tiny_llama_config(**size), Path(tmp) / "llama")
        for name, eager in (("graphs", False), ("eager", True)):
            engine_args = EngineArgs(model=str(path), dtype="bfloat16", max_model_len=context + steps + 16,
                                     max_num_seqs=batch, max_num_batched_tokens=max(2048, context),
                                     enforce_eager=eager, **({"num_kv_blocks": 64} if args.dry_run else {}))
            result = measure_decode_floor(engine_args, batch, context, steps,
                                          bandwidth_bytes=(1 << 24) if args.dry_run else (1 << 30))
            rows.append({"decode": name, **{k: result[k] for k in (
                "batch_size", "context_len", "copy_bandwidth_gb_s", "weight_bytes_per_step", "kv_bytes_per_step",
                "floor_ms", "median_step_ms", "min_step_ms", "ratio_to_floor", "decode_tokens_per_s")}})
    return {"passed": True, "rows": rows}


def run_tests(torch, device, args) -> dict:
    files = ["tests/test_triton_attention.py", "tests/test_cuda_graphs.py", "tests/test_nccl_groups.py",
             "tests/test_cuda_attention_paths.py", "tests/test_merge.py"]
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
