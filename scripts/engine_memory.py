"""An engine's resident memory as it meets many token counts: rounds of prompts of random lengths, the process's
RSS and glibc's heap (`mallinfo2`: in use, free but held) printed every few rounds. A cache that keeps something
per shape shows as memory that keeps rising; a bounded one levels off (BENCHMARKS.md section 32).

    PYTHONPATH=$PWD .venv/bin/python scripts/engine_memory.py --rounds 15
    KVSHARD_ONEDNN_LINEAR=0 PYTHONPATH=$PWD .venv/bin/python scripts/engine_memory.py --rounds 15   # torch's products

One rank in this process (tp=1), no prefix cache, so every round runs new prompts.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _rss_mb() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return -1


def _heap() -> str:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):  # not glibc 2.33+
        return "heap: n/a"
    return f"heap in use {info.uordblks >> 20} MiB, free but held {info.fordblks >> 20} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=40, help="prompts a round")
    parser.add_argument("--max-prompt-len", type=int, default=700)
    parser.add_argument("--every", type=int, default=3, help="print every this many rounds")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--max-token-id", type=int, default=40000, help="prompt ids drawn from [100, this)")
    args = parser.parse_args(argv)

    from kvshard import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=2048, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=False)
    top = min(args.max_token_id, llm.engine.config.model.hf_config.vocab_size)
    rng = random.Random(0)
    print(f"start: RSS {_rss_mb()} MB, {_heap()}", flush=True)
    for number in range(1, args.rounds + 1):
        prompts = [{"prompt_token_ids": [rng.randrange(100, top) for _ in range(rng.randrange(5, args.max_prompt_len))]}
                   for _ in range(args.prompts)]
        llm.generate(prompts, SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0), use_tqdm=False)
        if number % args.every == 0:
            print(f"round {number}: RSS {_rss_mb()} MB, {_heap()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
