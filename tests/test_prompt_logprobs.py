"""Prompt logprobs (`SamplingParams.prompt_logprobs`), on one rank (fast): what transformers' one forward
pass over the prompt gives, also when the prompt is prefilled in chunks or its prefix is cached."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_llama_config
from kvshard import LLM, SamplingParams
from kvshard.engine.sequence import Sequence

CHUNK = 16  # tokens per step: the long prompt is prefilled over several steps
PROMPTS = [list(range(3, 60)), [7, 8, 9, 10, 11], [42]]
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    return checkpoints("prompt-logprobs-llama", tiny_llama_config())


@pytest.fixture(scope="module")
def llm(checkpoint):
    # block_size 4: the long prompt spans whole blocks, which the prefix cache would otherwise reuse
    with LLM(str(checkpoint), block_size=4, max_num_seqs=4, max_num_batched_tokens=CHUNK) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[torch.Tensor]:
    """transformers' log-probabilities [len(prompt), V] at every prompt position, one forward each."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0].log_softmax(dim=-1) for p in PROMPTS]


def assert_prompt_logprobs(got: list[dict[int, float] | None], prompt: list[int], want: torch.Tensor, top: int):
    """None first; then at each position the actual next token and the top-`top`, as transformers gives them."""
    assert len(got) == len(prompt) and got[0] is None
    for position, entry in enumerate(got[1:]):
        best = set(want[position].topk(top).indices.tolist()) if top else set()
        assert set(entry) == best | {prompt[position + 1]}, f"position {position}"
        for token, logprob in entry.items():
            assert logprob == pytest.approx(want[position, token].item(), abs=1e-5), f"position {position}"


def test_prompt_logprobs_equal_transformers_over_chunked_prefill(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert len(PROMPTS[0]) > 3 * CHUNK
    for output, prompt, want in zip(outputs, PROMPTS, reference):
        assert_prompt_logprobs(output.prompt_logprobs, prompt, want, TOP)
    # zero alternatives: the actual token alone; not asked: None
    only = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert_prompt_logprobs(only.prompt_logprobs, PROMPTS[0], reference[0], 0)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(llm, reference):
    llm.engine.reset_prefix_cache()
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(PROMPTS[:1], plain, use_tqdm=False)  # caches the prompt's full blocks
    hits = llm.engine.stats().prefix_cache_hits
    output = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)[0]
    assert llm.engine.stats().prefix_cache_hits == hits
    assert_prompt_logprobs(output.prompt_logprobs, PROMPTS[0], reference[0], 1)
    llm.generate(PROMPTS[:1], plain, use_tqdm=False)
    assert llm.engine.stats().prefix_cache_hits > hits  # without prompt logprobs the cache still serves


def test_n_samples_share_one_list_of_prompt_logprobs(llm, reference):
    output = llm.generate(PROMPTS[1:2], SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert len(output.outputs) == 3
    assert_prompt_logprobs(output.prompt_logprobs, PROMPTS[1], reference[1], 2)


def test_a_recomputed_prompt_keeps_the_logprobs_it_has():
    """After a preemption the prompt is computed again from position 0: only missing positions are taken."""
    seq = Sequence("r", 0, [1, 2, 3, 4, 5, 6], SamplingParams(prompt_logprobs=1), None)
    assert seq.pending_prompt_logprobs(0, 4) == range(0, 4)
    seq.prompt_logprobs.extend({t: 0.0} for t in (2, 3, 4))
    assert seq.pending_prompt_logprobs(0, 4) == range(3, 4)
    assert seq.pending_prompt_logprobs(4, 6) == range(4, 5)  # the last prompt position samples, it predicts no prompt token
    assert Sequence("r", 1, [1, 2, 3], SamplingParams(prompt_logprobs=1), None).pending_prompt_logprobs(0, 3) == range(0)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_invalid_prompt_logprobs_say_what_is_wrong(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)
