"""cProfile of rank 0's decode steps: where a step's time goes, as shares of `LLMEngine.step`.

    PYTHONPATH=$PWD python scripts/profile_decode_step.py --model kvshard-demo-gqa --requests 32

Starts an in-process engine (tp=1), prefills `--requests` random prompts, then profiles `--steps`
decode steps and prints the cumulative share of each part of the step: schedule, plan (rows, plan,
block-table changes), the rank's metadata, the model, sampling, and the rest (output processing,
bookkeeping). cProfile slows Python code more than the model's kernels, so the shares of the Python
parts read high: compare shares of one build with another, not with an unprofiled step.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys

PARTS = {  # part -> (file suffix, function name) whose cumulative times it sums
    "schedule": [("engine/scheduler.py", "schedule")],
    "plan": [("engine/step_plan.py", "from_batch"), ("engine/block_tables.py", "changes")],
    "metadata": [("engine/model_runner.py", "metadata"), ("engine/block_tables.py", "apply")],
    "model": [("engine/model_runner.py", "execute")],  # less the metadata below
    "sampling": [("engine/sampler.py", "verify_drafts")],
    "output": [("engine/llm_engine.py", "_process_samples")],  # less sampling below
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="kvshard-demo-gqa")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--top", type=int, default=0, help="also print the N functions of most own time")
    args = parser.parse_args(argv)

    from kvshard.entrypoints.llm import LLM
    from kvshard.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.requests, max_model_len=args.prompt_len + 512)
    engine = llm.engine
    vocab = engine.config.model.hf_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    while any(seq.num_uncomputed_tokens != 1 for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    running = len(engine.scheduler.running)
    stats = pstats.Stats(profile)
    cumulative = {}
    for (path, _, name), (_, _, _, cum, _) in stats.stats.items():
        cumulative[(path, name)] = cumulative.get((path, name), 0.0) + cum

    def part(entries):
        return sum(t for (path, name), t in cumulative.items() for suffix, fn in entries
                   if name == fn and path.endswith(suffix))

    step = part([("engine/llm_engine.py", "step")])
    shares = {name: part(entries) for name, entries in PARTS.items()}
    shares["model"] -= shares["metadata"]  # the metadata is built inside ModelRunner.execute
    shares["output"] -= shares["sampling"]
    shares["other"] = step - sum(shares.values())
    print(f"{args.model}, {running} running requests, {args.steps} decode steps: {step / args.steps * 1e3:.2f} ms "
          f"per step under cProfile (busy machine: shares only)")
    for name, seconds in shares.items():
        print(f"  {name:9s} {100 * seconds / step:5.1f}%")
    if args.top:
        stats.sort_stats("tottime").print_stats(args.top)
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
