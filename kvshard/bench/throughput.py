"""`kvshard bench throughput`: offline throughput, as nano-vllm's bench.py and `vllm bench throughput`.

N requests of the workload (random token ids by default, lengths drawn from
the seed), generated in full (`ignore_eos`, greedy) by one engine in one
`generate` call; the result is requests/s, output tok/s and total tok/s.
Before the first timed pass an untimed warm-up runs the same requests with at
most 8 output tokens each (every prefill shape and the full decode batch, so
neither engine's first repeat pays for first-time allocations), and the prefix
cache is emptied before every timed pass (a repeat must not read the previous
pass's prompts from the cache; the random prompts share no prefix among
themselves). `--engine vllm` runs the same request list through vLLM's
offline `LLM` instead; vLLM is imported only then, so it may live in another
virtual environment:

    PYTHONPATH=/path/to/kvshard /path/to/vllm-venv/bin/python -m kvshard.bench throughput --engine vllm ...
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from kvshard.bench.serve import BenchmarkError, request_list_digest
from kvshard.bench.workloads import BenchRequest

if TYPE_CHECKING:
    from kvshard.engine.arg_utils import EngineArgs

ENGINES = ("kvshard", "vllm")
WARMUP_OUTPUT_TOKENS = 8


def warmup_requests(requests: list[BenchRequest]) -> list[BenchRequest]:
    """The same prompts with at most WARMUP_OUTPUT_TOKENS output tokens each."""
    return [replace(r, output_len=min(r.output_len, WARMUP_OUTPUT_TOKENS)) for r in requests]


def run_kvshard(engine_args: EngineArgs, requests: list[BenchRequest], repeats: int = 1,
                progress: bool = True) -> tuple[list[float], int, dict]:
    """(seconds of each repeat, output tokens of one, engine description) of kvshard generate calls."""
    from kvshard import LLM, SamplingParams

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)

    with LLM(**asdict(engine_args)) as llm:
        warmup = warmup_requests(requests)
        llm.generate([r.prompt_token_ids for r in warmup], [params(r) for r in warmup], use_tqdm=False)
        times = []
        before = llm.engine.stats()
        for _ in range(repeats):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate([r.prompt_token_ids for r in requests], [params(r) for r in requests],
                                   use_tqdm=progress)
            times.append(time.perf_counter() - start)
        after = llm.engine.stats()
        config = llm.config
        described = {
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "decode_context_parallel_size": config.parallel.decode_context_parallel_size,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_model_len": config.scheduler.max_model_len,
            "kv_capacity_tokens": config.kv_capacity_tokens,
            "dtype": str(config.model.dtype).removeprefix("torch."),
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "torch_threads_rank0": torch_threads(),
            "engine_steps_per_pass": (after.steps - before.steps) / repeats,
        }
        if config.speculative is not None:
            drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
            accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
            described["speculative"] = {
                "method": config.speculative.method,
                "num_speculative_tokens": config.speculative.num_speculative_tokens,
                "drafts": drafts,
                "draft_tokens": after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                "accepted_tokens": accepted, "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            }
        if after.dcp_timing is not None and after.dcp_timing.steps:
            timing = after.dcp_timing.since(before.dcp_timing)
            described["dcp_timing"] = timing.summary()
    return times, sum(len(o.outputs[0].token_ids) for o in outputs), described


def run_vllm(model_path: str, engine_kwargs: dict, requests: list[BenchRequest], repeats: int = 1,
             progress: bool = True) -> tuple[list[float], int, dict]:
    """The same through vLLM (its prefix cache on or off as kvshard's, emptied before each pass)."""
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as error:
        raise BenchmarkError(f"--engine vllm needs vLLM in this Python ({error}): run `PYTHONPATH=/path/to/kvshard "
                             "python -m kvshard.bench throughput ...` with the Python of vLLM's virtual "
                             "environment") from None

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)

    llm = LLM(model_path, **engine_kwargs)
    warmup = warmup_requests(requests)
    llm.generate([TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in warmup],
                 [params(r) for r in warmup], use_tqdm=False)
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests],
                               [params(r) for r in requests], use_tqdm=progress)
        times.append(time.perf_counter() - start)
    described = dict(engine_kwargs)
    described["dtype"] = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")  # what vLLM ran in
    return times, sum(len(o.outputs[0].token_ids) for o in outputs), described


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def engine_version(engine: str) -> str:
    if engine == "vllm":
        import vllm

        return vllm.__version__
    import kvshard

    return kvshard.__version__


def throughput_result(engine: str, model: str, requests: list[BenchRequest], times: list[float], output_tokens: int,
                      engine_config: dict) -> dict:
    """Rates of the median repeat; every repeat's seconds are kept."""
    input_tokens = sum(r.input_len for r in requests)
    elapsed = sorted(times)[len(times) // 2]
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "engine": engine, "engine_version": engine_version(engine), "engine_config": engine_config,
        "model": model, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "num_requests": len(requests), "requests_digest": request_list_digest(requests),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "expected_output_tokens": sum(r.output_len for r in requests),
        "elapsed_s": elapsed, "elapsed_s_each_repeat": times,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        "output_tokens_per_s_each_repeat": [output_tokens / t for t in times],
    }


def format_throughput(result: dict) -> str:
    repeats = result["output_tokens_per_s_each_repeat"]
    spread = f"; median of {len(repeats)}: " + ", ".join(f"{r:.0f}" for r in repeats) if len(repeats) > 1 else ""
    config = result["engine_config"]
    lines = []
    if "engine_steps_per_pass" in config:
        steps = config["engine_steps_per_pass"]
        lines.append(f"engine steps per pass: {steps:.0f} ({result['elapsed_s'] / steps * 1e3:.1f} ms per step)")
    if "speculative" in config:
        spec = config["speculative"]
        lines.append(f"speculative decoding ({spec['method']}, k={spec['num_speculative_tokens']}): "
                     f"{spec['accepted_tokens']:,} of {spec['draft_tokens']:,} drafts accepted, "
                     f"mean acceptance length {spec['mean_acceptance_length']:.2f}")
    if "dcp_timing" in config:
        lines.append(config["dcp_timing"])
    lines.append(
        f"Throughput ({result['engine']} {result['engine_version']}, {result['num_requests']} requests, "
        f"digest {result['requests_digest']}): {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s, {result['output_tokens_per_s']:.2f} output tokens/s "
        f"({result['total_output_tokens']:,} of {result['expected_output_tokens']:,} output tokens "
        f"in {result['elapsed_s']:.2f} s{spread})")
    return "\n".join(lines)
