"""Features a serving user turns on together, each checked against the same requests without the other:
speculative decoding with prefix caching (a conversation's next turn reuses the KV of the drafts accepted in
the previous turn's last step, as it would without speculation), and stop strings with min_tokens (as vLLM:
no stop string ends the output before it is longer than min_tokens). One small engine at tp=1, greedy.
"""

from __future__ import annotations

import pytest

from kvshard import LLM, SamplingParams

MODEL = "kvshard-demo-gqa"
BLOCK = 4  # tokens per block: a few drafts fill a block
K = 3  # drafts per step
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, max_model_len=128, kv_cache_memory="16MiB", block_size=BLOCK, speculative_config=NGRAM) as engine:
        yield engine


def greedy(llm: LLM, prompt, **fields):
    return llm.generate([prompt], SamplingParams(temperature=0, **fields), use_tqdm=False)[0]


def test_the_next_turn_reuses_the_drafts_accepted_in_the_last_step(llm, monkeypatch):
    """Every draft is the reference continuation, so each step after the prefill accepts all K and the last
    one ends the request at max_tokens: its accepted drafts' K/V are computed and must be named for the prefix
    cache, so the next turn (prompt + answer + more) finds every full block of prompt and answer but the last
    token's, as without speculation. Before, a request ending inside an accepted run dropped those blocks."""
    prompt = [5, 9, 5, 9, 5, 9, 77] * 4
    max_tokens = 1 + (K + 1) * 3  # the prefill's token, then three steps of K drafts and the token after them
    answer = greedy(llm, prompt, max_tokens=max_tokens).outputs[0].token_ids
    full = prompt + answer

    def scripted(token_ids: list[int], max_drafts: int) -> list[int]:
        return full[len(token_ids):len(token_ids) + max_drafts] if full[:len(token_ids)] == token_ids else []

    monkeypatch.setattr(llm.engine.proposer, "propose", scripted)
    llm.reset_prefix_cache()
    accepted = llm.engine.stats().spec_decode_num_accepted_tokens
    first = greedy(llm, prompt, max_tokens=max_tokens).outputs[0]
    assert first.token_ids == answer and first.finish_reason == "length"
    assert llm.engine.stats().spec_decode_num_accepted_tokens - accepted == 3 * K  # the last step's run too
    hits = llm.engine.stats().prefix_cache_hits
    second = greedy(llm, full + [3, 4, 5], max_tokens=2)
    computed = len(prompt) + max_tokens - 1  # the last answer token was sampled, never computed
    assert second.num_cached_tokens == computed // BLOCK * BLOCK
    assert llm.engine.stats().prefix_cache_hits - hits == second.num_cached_tokens
    assert llm.engine.stats().kv_blocks_used == 0


def test_no_stop_string_ends_the_output_before_min_tokens(llm):
    """A stop string that the first tokens' text completes ends a plain request there; with min_tokens it is
    not looked for until the output is longer than min_tokens, as EOS and stop_token_ids are held back."""
    prompt = "The quick brown fox"
    reference = greedy(llm, prompt, max_tokens=12).outputs[0]
    tokenizer = llm.get_tokenizer()
    # the first character the first (up to) four tokens write: a stop string the plain request meets there
    texts = (tokenizer.decode(reference.token_ids[:j], skip_special_tokens=True) for j in range(1, 5))
    stop = next(c for text in texts for c in text if c not in "\ufffd ")
    plain = greedy(llm, prompt, max_tokens=12, stop=[stop]).outputs[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) <= 4  # the stop string is met early
    held = greedy(llm, prompt, max_tokens=12, stop=[stop], min_tokens=6).outputs[0]
    assert len(held.token_ids) > 6
    assert held.token_ids == reference.token_ids[:len(held.token_ids)]
