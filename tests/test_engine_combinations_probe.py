"""Requests of random settings, added and aborted between steps of small engines driven directly: plain,
with n-gram or draft-model speculation, and with prefix caching under a KV budget so tight that requests are
preempted (with each kind of speculation, and with prompts prefilled in small chunks). A request's own settings
may fail that request (finish_reason "error") or be refused when it is made or added (ValueError); they never
make `LLMEngine.step` raise. Every request ends within a bound of
steps, its blocks go back to the pool, and greedy outputs under speculation are those of the plain engine.
Seeded: the same cases every run.
"""

from __future__ import annotations

import random

import pytest

from kvshard import LLM, SamplingParams
from kvshard.sampling_params import StructuredOutputsParams

MODEL = "kvshard-demo-gqa"
EOS = 1
SPECIAL = [0, 1]  # the demo tokenizer's <|begin|> and <|end|>
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT_MODEL = {"model": MODEL, "num_speculative_tokens": K}
ENGINE = dict(max_model_len=96, kv_cache_memory="16MiB", block_size=4)
# 4 KiB per block of 4 tokens: 30 blocks, 120 tokens, while one sequence may reach max_model_len (24 blocks)
TIGHT = dict(ENGINE, kv_cache_memory=30 * 4096)
# a draft model's KV shares the budget: 30 blocks each; small token budgets chunk the prompts
TIGHT_DRAFT = dict(ENGINE, kv_cache_memory=60 * 4096)
CHUNKED = dict(max_num_batched_tokens=8, max_num_seqs=3)
MAX_STEPS = 1500  # every case of a round ends well before

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
          "required": ["a", "b"]}
CONSTRAINTS = [
    lambda: StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
    lambda: StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    lambda: StructuredOutputsParams(regex=r"[a-c]{2,6}"),
    lambda: StructuredOutputsParams(json_object=True),
]


@pytest.fixture(scope="module")
def engines():
    with LLM(MODEL, **ENGINE) as plain, LLM(MODEL, speculative_config=NGRAM, **ENGINE) as ngram, \
            LLM(MODEL, speculative_config=DRAFT_MODEL, **ENGINE) as drafted, \
            LLM(MODEL, enable_prefix_caching=True, **TIGHT) as tight, \
            LLM(MODEL, enable_prefix_caching=True, speculative_config=NGRAM, **CHUNKED, **TIGHT) as tight_ngram, \
            LLM(MODEL, enable_prefix_caching=True, speculative_config=DRAFT_MODEL, **TIGHT_DRAFT) as tight_draft:
        yield {"plain": plain, "ngram": ngram, "draft": drafted, "tight": tight, "tight_ngram": tight_ngram,
               "tight_draft": tight_draft}


def random_prompt(rng: random.Random) -> list[int]:
    """Token ids with repeated n-grams (n-gram drafts fire), at times EOS or the other special token inside."""
    gram = [rng.randrange(2, 512) for _ in range(rng.randint(1, 4))]
    prompt = [rng.randrange(2, 512) for _ in range(rng.randint(0, 4))]
    for _ in range(rng.randint(1, 5)):
        prompt += gram
        if rng.random() < 0.3:
            prompt.append(rng.choice(SPECIAL))
        if rng.random() < 0.3:
            prompt.append(rng.randrange(2, 512))
    return prompt[:30]


def random_fields(rng: random.Random, prompt: list[int]) -> dict:
    fields: dict = {"n": rng.choice([1, 1, 2, 3]), "max_tokens": rng.choice([rng.randint(1, 40)] * 9 + [None])}
    if rng.random() < 0.5:
        fields["temperature"] = 0.0
    else:
        fields.update(temperature=0.7, seed=rng.randrange(1 << 20))
    maybe = lambda p: rng.random() < p  # noqa: E731
    if maybe(0.3):
        fields["top_p"] = rng.choice([0.1, 0.5, 0.9])
    if maybe(0.3):
        fields["top_k"] = rng.choice([0, 1, 5, 50])
    if maybe(0.2):
        fields["min_p"] = rng.choice([0.05, 0.5, 1.0])
    if maybe(0.3):
        fields["min_tokens"] = rng.randint(0, (fields["max_tokens"] or 40) + 2)  # at times above: refused
    if maybe(0.2):
        fields["stop"] = rng.sample(["a", "e", " ", "the", "\n", "}", "yes"], rng.randint(1, 3))
    if maybe(0.4):
        pool = [EOS, 0] + prompt
        fields["stop_token_ids"] = rng.sample(pool, min(len(pool), rng.randint(1, 4)))
    if maybe(0.3):
        fields["ignore_eos"] = True
    if maybe(0.3):
        fields["logprobs"] = rng.randint(0, 5)
    if maybe(0.2):
        fields["prompt_logprobs"] = rng.randint(0, 5)
    if maybe(0.2):
        fields["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if maybe(0.2):
        fields["presence_penalty"] = rng.choice([-2.0, 0.5, 2.0])
    if maybe(0.2):
        fields["frequency_penalty"] = rng.choice([-2.0, 0.4, 2.0])
    if maybe(0.2):
        tokens = rng.sample([EOS, 0] + prompt + [rng.randrange(512)], 2)
        fields["logit_bias"] = {t: rng.choice([-100.0, -5.0, 5.0, 100.0]) for t in tokens}
    if maybe(0.15):
        fields["bad_words"] = rng.sample(["the", "a", "yes", "no", "{", "1"], rng.randint(1, 2))
    if maybe(0.2):
        fields["include_stop_str_in_output"] = True
    if maybe(0.25):
        fields["structured_outputs"] = rng.choice(CONSTRAINTS)()
    return fields


def make_cases(seed: int, count: int) -> list[tuple[list[int], SamplingParams | None, dict]]:
    """(prompt, params, fields); params is None where SamplingParams refused the fields."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        prompt = random_prompt(rng)
        fields = random_fields(rng, prompt)
        try:
            params = SamplingParams(**fields)
        except ValueError:
            params = None
        cases.append((prompt, params, fields))
    return cases


def drive(llm: LLM, cases, seed: int, abort_rate: float = 0.05) -> dict[str, object]:
    """Add the cases a few at a time between steps, abort some; returns each request's final output (or the
    ValueError that refused it). step() must never raise, and every request must end within MAX_STEPS."""
    engine = llm.engine
    rng = random.Random(seed)
    pending = list(enumerate(cases))
    finals: dict[str, object] = {}
    live: list[str] = []
    steps = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if not pending:
                break
            index, (prompt, params, fields) = pending.pop(0)
            request_id = f"r{index}"
            if params is None:
                finals[request_id] = ValueError("refused at construction")
                continue
            try:
                engine.add_request(request_id, list(prompt), SamplingParams(**fields))
            except ValueError as error:
                finals[request_id] = error
                continue
            live.append(request_id)
        if live and rng.random() < abort_rate:  # the newest at times: before its first step
            victim = rng.choice([live[-1], rng.choice(live)])
            engine.abort_request(victim)
            engine.abort_request(victim)  # twice: the second is ignored
            live.remove(victim)
            finals[victim] = "aborted"
        try:
            outputs = engine.step()
        except Exception as error:  # the bug this probe looks for
            raise AssertionError(f"step() raised on step {steps} with {sorted(live)} live: {error!r}") from error
        steps += 1
        assert steps < MAX_STEPS, f"requests {sorted(live)} did not end within {MAX_STEPS} steps"
        for output in outputs:
            assert output.request_id in live, output
            if output.finished:
                live.remove(output.request_id)
                finals[output.request_id] = output
                assert all(c.finish_reason is not None for c in output.outputs), output
                if output.error is not None:  # a sibling that ended before keeps its own reason
                    assert any(c.finish_reason == "error" for c in output.outputs), output
    assert not live and not engine.requests
    assert engine.pool.num_used == 0  # prefix-cached blocks that are free do not count
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return finals


def comparable(fields: dict) -> bool:
    """Greedy requests: speculation must keep their tokens, and their failures."""
    return fields.get("temperature") == 0.0


def run_alone(llm: LLM, prompt: list[int], fields: dict):
    engine = llm.engine
    engine.add_request("alone", list(prompt), SamplingParams(**fields))
    final = None
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            final = output
    assert final is not None and final.finished
    return final


ROUNDS = [("plain", 11), ("ngram", 12), ("draft", 13), ("tight", 14), ("tight_ngram", 15), ("tight_draft", 16)]


@pytest.mark.parametrize("name, seed", ROUNDS, ids=[name for name, _ in ROUNDS])
def test_random_requests_never_end_the_engine(engines, name, seed):
    cases = make_cases(seed, 60)
    preemptions = engines[name].engine.stats().num_preemptions
    finals = drive(engines[name], cases, seed)
    assert len(finals) == len(cases)
    ended = [f for f in finals.values() if not isinstance(f, (str, Exception))]
    assert len(ended) >= len(cases) // 2  # most cases are valid and run
    if name.startswith("tight"):  # the budget was tight: requests were preempted and recomputed
        assert engines[name].engine.stats().num_preemptions > preemptions
    if name == "plain":
        return
    plain = engines["plain"]
    for index, (prompt, params, fields) in enumerate(cases):
        final = finals[f"r{index}"]
        if isinstance(final, (str, Exception)) or not comparable(fields):
            continue
        want = run_alone(plain, prompt, fields)  # failed there too, if it failed here (and on the same token)
        assert (final.error is None) == (want.error is None), (prompt, fields, final.error, want.error)
        got = [(c.token_ids, c.finish_reason) for c in final.outputs]
        assert got == [(c.token_ids, c.finish_reason) for c in want.outputs], (prompt, fields)
