"""One `kvshard bench dcp` point without HTTP: where TP + DCP's tokens per rank go.

The same requests as `kvshard bench dcp`'s point at --concurrency (its default workload: agentic prompts x
1/512, outputs x 1/2, seed 0; the point's first concurrency x --prompts-per-concurrency of them) run in this
process against an `LLM` engine, --concurrency in flight, a finished request replaced by the next, for TP
alone and for TP + DCP at the same per-rank KV budget. Both engines are up at once, each in a process of its
own, and they take turns in slices of --slice seconds (the idle one's ranks nap): on a machine whose speed
drifts from minute to minute (the 2-core VMs of BENCHMARKS.md moved a layout's tok/s by 20% between runs a
minute apart), both layouts see the same drift, and only the stretch after one of them finished runs alone.
--rounds repeats the whole comparison.

Per layout and round it prints the output tok/s per rank (tokens over the seconds its own slices took) and
what the engine did: steps, decodes and prompt
tokens a step, preemptions, the share of the time with no request waiting (the point's tail, where fewer
requests are left to batch), and a least-squares fit of the steps' times,
ms = F + a * decodes + b * prompt tokens + c * (thousands of context tokens).

Then, from each round's pair, the two layouts' times as steps x (a fixed cost per step, F) + the work their
tokens take, W (the same requests: the same prompts to prefill and the same answers to decode):

    T_tp = S_tp * F + W,   T_dcp = S_dcp * F + W

DCP's gain per rank is T_tp / T_dcp, at most S_tp / S_dcp (the running requests' ratio): W, which DCP does not
divide, holds it below that, and the script prints the W that a target ratio would need.

    PYTHONPATH=$PWD .venv/bin/python scripts/dcp_closed_loop.py
    PYTHONPATH=$PWD .venv/bin/python scripts/dcp_closed_loop.py --rounds 3 --prompts-per-concurrency 8
    PYTHONPATH=$PWD .venv/bin/python scripts/dcp_closed_loop.py --rounds 1 -O 3   # both engines compiled
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import uuid
from fractions import Fraction

import numpy as np

from kvshard import LLM, SamplingParams
from kvshard.bench.serve import request_list_digest
from kvshard.bench.workloads import WorkloadSpec


def run_point(conn, model: str, tp: int, dcp: int, requests, concurrency: int, kv_cache_memory: str,
              max_model_len: int, max_num_seqs: int, enable_expert_parallel: bool = False,
              compilation_config: int = 0) -> None:
    """A layout's closed loop in slices: each ("run", seconds) from `conn` runs steps for about that long and
    answers whether the point is done; at the end, its figures."""
    with LLM(model=model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, kv_cache_memory=kv_cache_memory,
             max_num_seqs=max_num_seqs, max_model_len=max_model_len,
             enable_expert_parallel=enable_expert_parallel, compilation_config=compilation_config) as llm:
        engine = llm.engine
        scheduler = engine.scheduler
        batches = []  # (decodes, prompt tokens, context tokens) of each step's batch
        schedule = scheduler.schedule

        def observed_schedule():
            batch = schedule()
            if batch is not None:
                batches.append((sum(n == 1 for n in batch.query_lens), sum(n for n in batch.query_lens if n != 1),
                                sum(batch.context_lens)))
            return batch

        scheduler.schedule = observed_schedule
        pending = list(requests)
        produced: dict[str, int] = {}

        def add() -> None:
            request = pending.pop(0)
            request_id = f"loop-{uuid.uuid4().hex[:8]}"
            engine.add_request(request_id, request.prompt_token_ids,
                               SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True))
            produced[request_id] = 0

        while pending and len(produced) < concurrency:
            add()
        steps, tokens, elapsed = [], 0, 0.0
        conn.send("ready")
        while produced:
            command, seconds = conn.recv()
            start = time.perf_counter()
            while produced and time.perf_counter() - start < seconds:
                before = len(batches)
                step_start = time.perf_counter()
                outputs = engine.step()
                took = time.perf_counter() - step_start
                if len(batches) > before:
                    steps.append((took, not scheduler.waiting))
                for output in outputs:
                    n = len(output.outputs[0].token_ids)
                    tokens += n - produced.get(output.request_id, 0)
                    produced[output.request_id] = n
                    if output.finished:
                        del produced[output.request_id]
                        if pending:
                            add()
            elapsed += time.perf_counter() - start
            conn.send(not produced)
        preemptions = scheduler.num_preemptions
    times = np.array([t for t, _ in steps]) * 1e3
    idle_queue = np.array([empty for _, empty in steps])
    shape = np.array(batches[:len(steps)], dtype=float)
    design = np.column_stack([np.ones(len(times)), shape[:, 0], shape[:, 1], shape[:, 2] / 1e3])
    fit = np.linalg.lstsq(design, times, rcond=None)[0]
    conn.send({
        "tp": tp, "dcp": dcp, "seconds": elapsed, "output_tokens": tokens,
        "output_tok_s_per_rank": tokens / elapsed / tp, "steps": len(steps), "ms_per_step": float(times.mean()),
        "decodes_per_step": float(shape[:, 0].mean()), "prompt_tokens_per_step": float(shape[:, 1].mean()),
        "preemptions": preemptions, "empty_queue_share": float(times[idle_queue].sum() / times.sum()),
        "fit_ms": {"fixed": float(fit[0]), "per_decode": float(fit[1]), "per_prompt_token": float(fit[2]),
                   "per_1k_context": float(fit[3])},
        "step_records": [[float(t), *map(float, b), bool(e)] for t, b, e in zip(times, shape, idle_queue)],
    })


def compare(layouts: list[int], slice_s: float, **point) -> dict[int, dict]:
    """Both layouts' points, their engines up at once, taking turns in slices of `slice_s` seconds."""
    context = multiprocessing.get_context("spawn")
    workers = {}
    for dcp in layouts:
        parent, child = context.Pipe()
        process = context.Process(target=run_point, args=(child,), kwargs=dict(point, dcp=dcp))
        process.start()
        workers[dcp] = (process, parent)
    for process, conn in workers.values():
        if conn.recv() != "ready":
            raise RuntimeError("a layout's engine did not start")
    running = list(layouts)
    while running:
        for dcp in list(running):
            conn = workers[dcp][1]
            conn.send(("run", slice_s))
            if conn.recv():
                running.remove(dcp)
    results = {}
    for dcp, (process, conn) in workers.items():
        results[dcp] = conn.recv()
        process.join()
    return results


def decompose(tp_point: dict, dcp_point: dict, target: float) -> dict:
    """F and W from T = S * F + W for both layouts; the W that `target` x per rank would need at this F."""
    s1, t1 = tp_point["steps"], tp_point["seconds"]
    s2, t2 = dcp_point["steps"], dcp_point["seconds"]
    fixed = (t1 - t2) / (s1 - s2)
    work = t1 - s1 * fixed
    needed = (s1 - target * s2) * fixed / (target - 1) if target > 1 else float("nan")
    return {"fixed_ms_per_step": fixed * 1e3, "work_s": work, "ratio": t1 / t2, "ceiling": s1 / s2,
            "work_s_for_target": needed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="kvshard-demo")
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--dcp", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="7MiB")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompts-per-concurrency", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slice", type=float, default=2.0, help="seconds a layout runs before the other's turn")
    parser.add_argument("--context-scale", type=Fraction, default=Fraction(1, 512))
    parser.add_argument("--output-scale", type=Fraction, default=Fraction(1, 2))
    parser.add_argument("--vocab-size", type=int, default=512, help="the model's (the demo models': 512)")
    parser.add_argument("--target", type=float, default=1.6, help="the per-rank gain whose W is printed")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="whole routed experts on each rank (the engine's flag), not every expert split by width")
    parser.add_argument("-O", "--compilation-config", type=int, choices=(0, 3), default=0,
                        help="0: the eager model step (the default); 3: the compiled step, as `kvshard serve -O 3`")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    spec = WorkloadSpec("agentic", args.vocab_size, 0, input_len=1024, output_len=128, range_ratio=0.0,
                        context_scale=float(args.context_scale), output_scale=float(args.output_scale))
    wanted = args.concurrency * args.prompts_per_concurrency
    sessions = spec.sessions(max(wanted, 128))  # as `bench dcp` draws them: a point takes the first ones
    requests = [session[0] for session in sessions[:wanted]]
    print(f"{len(requests)} requests (digest {request_list_digest(requests)}), {args.concurrency} in flight, "
          f"KV {args.kv_cache_memory} per rank, max-model-len {spec.max_request_len()}")
    tp = args.tensor_parallel_size
    rounds = []
    for r in range(args.rounds):
        layouts = [1, args.dcp] if r % 2 == 0 else [args.dcp, 1]
        points = compare(layouts, args.slice, model=args.model, tp=tp, requests=requests,
                         concurrency=args.concurrency, kv_cache_memory=args.kv_cache_memory,
                         max_model_len=spec.max_request_len(), max_num_seqs=args.max_num_seqs,
                         enable_expert_parallel=args.enable_expert_parallel,
                         compilation_config=args.compilation_config)
        for dcp in (1, args.dcp):
            point = points[dcp]
            fit = point["fit_ms"]
            print(f"round {r + 1} TP={tp}{f' + DCP={dcp}' if dcp > 1 else ''}: "
                  f"{point['output_tok_s_per_rank']:.1f} out tok/s per rank, {point['steps']} steps of "
                  f"{point['ms_per_step']:.2f} ms, {point['decodes_per_step']:.2f} decodes and "
                  f"{point['prompt_tokens_per_step']:.1f} prompt tokens a step, {point['preemptions']} preemptions, "
                  f"{point['empty_queue_share']:.0%} of the time with no request waiting; step ms = "
                  f"{fit['fixed']:.2f} + {fit['per_decode']:.3f} x decodes + {fit['per_prompt_token']:.4f} x prompt "
                  f"tokens + {fit['per_1k_context']:.3f} x 1K context tokens", flush=True)
        parts = decompose(points[1], points[args.dcp], args.target)
        print(f"round {r + 1}: {parts['ratio']:.2f}x per rank (ceiling S_tp/S_dcp = {parts['ceiling']:.2f}x); "
              f"F = {parts['fixed_ms_per_step']:.2f} ms a step, W = {parts['work_s']:.2f} s; {args.target}x would "
              f"need W <= {parts['work_s_for_target']:.2f} s", flush=True)
        rounds.append({"points": points, "decomposition": parts})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}, f, indent=1,
                      default=float)


if __name__ == "__main__":
    main()
