"""`kvshard bench throughput`'s passes: warmed up on the workload's own shapes, and never served from the
prefix cache of the pass before (every repeat prefills every prompt)."""

from __future__ import annotations

from kvshard import LLM, SamplingParams
from kvshard.bench.throughput import WARMUP_OUTPUT_TOKENS, run_kvshard, warmup_requests
from kvshard.bench.workloads import BenchRequest
from kvshard.engine.arg_utils import EngineArgs

PROMPTS = [[5 + i] * 40 for i in range(3)]


def test_reset_prefix_cache_makes_the_same_prompt_prefill_again():
    params = SamplingParams(temperature=0, max_tokens=2)
    with LLM("kvshard-demo-gqa", block_size=4) as llm:
        first, = llm.generate([PROMPTS[0]], params, use_tqdm=False)
        again, = llm.generate([PROMPTS[0]], params, use_tqdm=False)
        llm.reset_prefix_cache()
        after_reset, = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert (first.num_cached_tokens, again.num_cached_tokens, after_reset.num_cached_tokens) == (0, 36, 0)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == after_reset.outputs[0].token_ids


def test_warm_up_runs_the_workloads_prompts_with_few_tokens():
    requests = [BenchRequest(p, 100) for p in PROMPTS] + [BenchRequest([9] * 7, 3, long_context=True)]
    warmup = warmup_requests(requests)
    assert [r.prompt_token_ids for r in warmup] == [r.prompt_token_ids for r in requests]
    assert [r.output_len for r in warmup] == [WARMUP_OUTPUT_TOKENS] * 3 + [3]
    assert warmup[-1].long_context


def test_every_repeat_prefills_every_prompt(monkeypatch):
    import kvshard.entrypoints.llm as llm_module

    cached: list[int] = []
    generate = llm_module.LLM.generate

    def recording_generate(self, *args, **kwargs):
        outputs = generate(self, *args, **kwargs)
        cached.append(sum(o.num_cached_tokens for o in outputs))
        return outputs

    monkeypatch.setattr(llm_module.LLM, "generate", recording_generate)
    requests = [BenchRequest(p, 4) for p in PROMPTS]
    times, output_tokens, described = run_kvshard(EngineArgs(model="kvshard-demo-gqa", block_size=4), requests,
                                                  repeats=2, progress=False)
    assert len(times) == 2 and output_tokens == 12 and described["enable_prefix_caching"]
    assert cached == [0, 0, 0]  # the warm-up, then two timed passes: none read the previous pass from the cache
