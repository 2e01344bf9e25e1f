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


def test_repeat_workload_asks_the_chat_model_to_copy_each_passage_in_its_template():
    from transformers import AutoTokenizer

    from kvshard.bench.text_workload import OUTPUT_MARGIN, PASSAGES, repeat_requests
    from kvshard.config import resolve_model_path

    path = resolve_model_path("kvshard-demo-gqa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = repeat_requests(path, len(PASSAGES) + 1)
    assert requests[-1].prompt_token_ids == requests[0].prompt_token_ids  # the passages cycle
    for request, passage in zip(requests, PASSAGES):
        assert passage in tokenizer.decode(request.prompt_token_ids)
        assert request.output_len == len(tokenizer.encode(passage)) + OUTPUT_MARGIN


def test_bench_throughput_runs_the_repeat_workload_with_ngram_speculation(capsys):
    from kvshard.bench.cli import main as bench_main

    assert bench_main(["throughput", "kvshard-demo-gqa", "--workload", "repeat", "--num-prompts", "2",
                       "--no-progress", "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}']) == 0
    printed = capsys.readouterr().out
    assert "workload: repeat: 2 chat requests" in printed
    assert "speculative decoding (ngram, k=3):" in printed and "mean acceptance length" in printed
    assert "engine steps per pass:" in printed
