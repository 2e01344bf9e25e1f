"""vLLM's sampling fields: min_p, repetition/presence/frequency penalties, min_tokens, logit_bias and bad_words.

Each processor is checked against the `transformers` logits processor of the same name on the same logits
(presence and frequency against OpenAI's formula), then end to end on a small engine (greedy), through
n-gram speculation (which must stay exact) and through both OpenAI routes; what kvshard does not implement
is refused with 400 instead of being ignored.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvshard import LLM, SamplingParams
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.engine.sampler import (NO_TOKEN_LEFT, _filtered_probs, greedy_tokens, process_logits, sample,
                                    verify_drafts)
from kvshard.engine.sequence import Sequence
from kvshard.entrypoints.openai_server import OpenAIServer
from kvshard.errors import RequestSettingsError

MODEL = "kvshard-demo-gqa"
VOCAB = 64
EOS = 1
ENGINE = dict(max_model_len=256, kv_cache_memory="16MiB")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["The cat", "Hello there"]  # greedy: "The cat" repeats one token six times, "Hello there" a pair


class WordTokenizer:
    """A stand-in tokenizer for `SamplingParams.prepare`: a word is written as its token ids, "10.11.12"."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(t) for t in text.split(".")] if not text.startswith(" ") else []


def seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    params.prepare(WordTokenizer(), [EOS], VOCAB)
    s = Sequence("r", 0, prompt, params, None)
    s.output_token_ids = list(output)
    return s


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# --- each processor against transformers, on the same logits -------------------------------------------

def test_repetition_penalty_matches_transformers():
    logits, prompt, output = random_logits(1), [3, 4, 5, 9], [9, 12, 12, 40]
    for penalty in (0.5, 1.3, 2.0):
        got = process_logits(logits, [seq(SamplingParams(repetition_penalty=penalty), prompt, output)])
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
        torch.testing.assert_close(got, want)
        assert not torch.equal(got, logits)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits, output = random_logits(1), [7, 7, 7, 8, 20]
    got = process_logits(logits, [seq(SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4), [7, 30], output)])
    want = logits.clone()
    for token, count in Counter(output).items():  # the prompt's tokens (30) are not penalised
        want[0, token] -= count * -0.4 + 0.7
    torch.testing.assert_close(got, want)


def test_min_p_matches_transformers():
    logits = random_logits(3)
    for min_p in (0.05, 0.3, 0.9):
        got = _filtered_probs(logits, [SamplingParams(min_p=min_p)] * 3)
        want = MinPLogitsWarper(min_p)(None, logits.clone()).softmax(dim=-1)
        torch.testing.assert_close(got, want)
        assert int((got > 0).sum()) < 3 * VOCAB


@pytest.mark.parametrize("output", [[], [5], [5, 6, 7]])
def test_min_tokens_matches_transformers(output):
    logits, prompt = random_logits(1), [3, 4]
    got = process_logits(logits, [seq(SamplingParams(min_tokens=3), prompt, output)])
    want = MinNewTokensLengthLogitsProcessor(len(prompt), 3, EOS)(torch.tensor([prompt + output]), logits.clone())
    torch.testing.assert_close(got, want)
    # stop_token_ids are held back too; with ignore_eos, only they
    held = process_logits(logits, [seq(SamplingParams(min_tokens=3, stop_token_ids=[9], ignore_eos=True),
                                       prompt, output)])
    assert bool(held[0, 9].isneginf()) == (len(output) < 3) and not held[0, EOS].isneginf()


@pytest.mark.parametrize("output", [[2], [10, 11], [10, 11, 12], [11, 12], [12, 12]])
def test_bad_words_match_transformers(output):
    """Multi-token words: the last token is banned where the others end the output."""
    logits, words = random_logits(1), [[2], [10, 11, 12], [12, 13]]
    s = seq(SamplingParams(bad_words=[".".join(map(str, w)) for w in words]), [3], output)
    got = process_logits(logits, [s])
    want = NoBadWordsLogitsProcessor(words, eos_token_id=EOS)(torch.tensor([output]), logits.clone())
    torch.testing.assert_close(got, want)


def test_logit_bias_matches_transformers_sequence_bias():
    logits, bias = random_logits(1), {4: 100.0, 9: -100.0, 20: 2.5}
    got = process_logits(logits, [seq(SamplingParams(logit_bias=bias), [3], [1])])
    want = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(torch.tensor([[3, 1]]), logits.clone())
    torch.testing.assert_close(got, want)


def test_rows_that_ask_for_nothing_are_left_alone():
    logits = random_logits(2)
    plain = seq(SamplingParams(), [3], [4])
    assert process_logits(logits, [plain, plain]) is logits  # nothing to do: not even a copy
    got = process_logits(logits, [plain, seq(SamplingParams(logit_bias={5: -100.0}), [3], [4])])
    assert torch.equal(got[0], logits[0]) and got[1, 5] == logits[1, 5] - 100


def test_verification_rows_see_their_drafts_as_output():
    """Greedy verification with penalties and bad words gives the tokens plain decoding gives, one at a time."""
    params = SamplingParams(temperature=0, repetition_penalty=1.8, frequency_penalty=1.5, min_tokens=2,
                            bad_words=["6.6"])
    s = seq(params, [3, 4], [])
    logits = torch.zeros(4, VOCAB)
    logits[:, 6] = 5.0  # the raw argmax of every row is 6: penalties and the bad word must move it
    logits[:, EOS] = 4.0
    logits[:, 8] = 3.0
    drafts = [6, 6, 8]
    (verified,) = verify_drafts(logits, [s], [drafts], torch.Generator())
    plain: list[int] = []
    for row in range(len(drafts) + 1):
        s.output_token_ids = drafts[:row]
        (token,) = sample(logits[row : row + 1], [s], torch.Generator())
        plain.append(token)
        if row == len(drafts) or token != drafts[row]:
            break
    assert verified == plain and verified != [6, 6, 6, 6]


EVERY_TOKEN = [str(t) for t in range(VOCAB)]  # as bad words of one token each: nothing left to say


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_whose_settings_leave_no_token_fails_alone_with_a_clear_error(temperature):
    logits = random_logits(2)
    stuck = seq(SamplingParams(temperature=temperature, bad_words=EVERY_TOKEN), [3], [4])
    plain = seq(SamplingParams(temperature=temperature, seed=7), [3], [4])
    plain.generator = torch.Generator().manual_seed(7)
    outcomes = sample(logits, [stuck, plain], torch.Generator())
    assert isinstance(outcomes[0], RequestSettingsError) and str(outcomes[0]) == NO_TOKEN_LEFT
    plain.generator = torch.Generator().manual_seed(7)
    assert outcomes[1] == sample(logits[1:], [plain], torch.Generator())[0]  # the other row as if alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafts_that_lead_to_no_token_are_cut_as_plain_decoding_would_stop(temperature):
    """Row 2 (after drafts 6, 7) has no token left: the drafts are cut before 7, and 7 can still come as the
    token after 6 (drawn from row 1, as plain decoding draws it); plain decoding then fails the step after."""
    dead_end = [f"6.7.{t}" for t in range(VOCAB)]
    s = seq(SamplingParams(temperature=temperature, bad_words=dead_end), [3], [])
    logits = torch.zeros(3, VOCAB)
    logits[0, 6] = logits[1, 7] = 20.0  # greedy (and almost surely sampled): 6, then 7
    for _ in range(5 if temperature else 1):
        (verified,) = verify_drafts(logits, [s], [[6, 7]], torch.Generator())
        assert verified == [6, 7], verified
    s.output_token_ids = [6, 7]
    (after,) = sample(logits[2:], [s], torch.Generator())
    assert isinstance(after, RequestSettingsError)


def test_stop_token_ids_that_cover_the_vocabulary_with_min_tokens_are_refused():
    every = list(range(VOCAB))
    with pytest.raises(ValueError, match="min_tokens: stop_token_ids .* cover every token"):
        seq(SamplingParams(min_tokens=2, stop_token_ids=every), [3], [])
    seq(SamplingParams(stop_token_ids=every), [3], [])  # without min_tokens any of them may end the output
    # EOS counts unless ignored: the rest of the vocabulary as stop tokens leaves EOS only where it is ignored
    rest = [t for t in every if t != EOS]
    with pytest.raises(ValueError, match="cover every token"):
        seq(SamplingParams(min_tokens=2, stop_token_ids=rest), [3], [])
    seq(SamplingParams(min_tokens=2, stop_token_ids=rest, ignore_eos=True), [3], [])


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("min_p", -0.1, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("frequency_penalty", "1", "frequency_penalty must be in [-2, 2]"),
    ("min_tokens", -1, "min_tokens must be an integer >= 0"),
    ("min_tokens", 17, "min_tokens must be at most max_tokens (16)"),
    ("min_tokens", True, "min_tokens must be an integer >= 0"),
    ("logit_bias", {"5": 1.0}, "logit_bias keys must be token ids"),
    ("logit_bias", {5: 101.0}, "logit_bias values must be in [-100, 100]"),
    ("logit_bias", {5: float("nan")}, "logit_bias values must be in [-100, 100]"),
    ("logit_bias", [5], "logit_bias must be a dict"),
    ("bad_words", ["ok", " "], "bad_words must be a list of strings that are not blank"),
    ("bad_words", [5], "bad_words must be a list of strings"),
    ("ignore_eos", "no", "ignore_eos must be true or false, got 'no'"),
    ("ignore_eos", 1, "ignore_eos must be true or false"),
    # vLLM's detokenizer settings: accepted at the values kvshard has, refused otherwise (as over HTTP)
    ("skip_special_tokens", False, "skip_special_tokens is not supported by kvshard; leave it at True or out"),
    ("spaces_between_special_tokens", False, "spaces_between_special_tokens is not supported by kvshard"),
    ("detokenize", False, "detokenize is not supported by kvshard"),
])
def test_invalid_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert str(error.value).startswith(message)


def test_a_producers_one_token_prefill_takes_the_clients_min_tokens():
    """`kvshard proxy` sends the client's fields with max_tokens=1 to the producer; the consumer checks them."""
    SamplingParams(max_tokens=1, min_tokens=5, kv_transfer_params={"do_remote_decode": True, "transfer_id": "t"})
    with pytest.raises(ValueError, match="min_tokens must be at most max_tokens"):
        SamplingParams(max_tokens=1, min_tokens=5, kv_transfer_params={"do_remote_prefill": True})


# --- end to end on a small engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(MODEL, **ENGINE)
    try:
        yield engine
    finally:
        engine.engine.shutdown()


def greedy(llm: LLM, prompts=PROMPTS, **fields) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, **fields)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_each_field_changes_the_greedy_output_as_it_should(llm):
    base = greedy(llm)
    tokenizer = llm.get_tokenizer()
    # logit_bias -100 on the tokens greedy picks first: they never appear
    first = {tokens[0] for tokens in base}
    banned = greedy(llm, logit_bias={t: -100.0 for t in first})
    assert banned != base and not first & {t for tokens in banned for t in tokens}
    # bad_words: a word greedy writes never comes out, bare or after a space (where, as vLLM, the spaced form
    # has as many tokens: " back" is one token but "back" two, so bad_words=["back"] leaves " back" alone)
    def as_word(token: int) -> tuple[str, set[int]]:
        word = tokenizer.decode([token]).strip()
        bare, spaced = (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word))
        return word, {ids[0] for ids in (bare, spaced) if len(ids) == 1 and len(bare) == 1}

    repeated, word, forbidden = next((t, *as_word(t)) for t, _ in Counter(base[1]).most_common()
                                     if t in as_word(t)[1])
    without = greedy(llm, bad_words=[word])
    assert without != base and not forbidden & {t for tokens in without for t in tokens}
    # min_tokens: EOS pushed to the top ends every answer at once, unless min_tokens holds it back
    assert [len(t) for t in greedy(llm, logit_bias={EOS: 100.0})] == [1, 1]
    held = greedy(llm, logit_bias={EOS: 100.0}, min_tokens=5)
    assert all(len(t) == 6 and EOS not in t[:5] and t[5] == EOS for t in held)
    # ... and so are stop_token_ids
    stop = [t[0] for t in base]
    assert [len(t) for t in greedy(llm, stop_token_ids=stop)] == [1, 1]
    assert [len(t) for t in greedy(llm, stop_token_ids=stop, min_tokens=4)] >= [4, 4]
    # penalties: fewer repeats
    def most_repeats(outputs):
        return max(Counter(t).most_common(1)[0][1] for t in outputs)
    for fields in ({"repetition_penalty": 2.0}, {"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = greedy(llm, **fields)
        assert most_repeats(penalised) < most_repeats(base), fields
    # min_p leaves the greedy choice alone
    assert greedy(llm, min_p=0.5) == base


def test_outputs_say_their_cumulative_logprob_and_stop_reason(llm):
    """vLLM's CompletionOutput.cumulative_logprob (the generated tokens' logprobs summed, with logprobs asked) and
    stop_reason (the stop string or stop_token_ids token that ended the output; None for EOS and for length)."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    base = llm.generate(PROMPTS, params, use_tqdm=False)
    for output in base:
        out = output.outputs[0]
        want = sum(entry[token] for entry, token in zip(out.logprobs, out.token_ids))
        assert out.cumulative_logprob == pytest.approx(want) and out.cumulative_logprob < 0
        assert out.finish_reason == "length" and out.stop_reason is None
    assert llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4),
                        use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    # each logprob reads as vLLM's Logprob (logprob, rank, decoded_token) and works as the float it is
    tokenizer = llm.get_tokenizer()
    for entry, token in zip(base[0].outputs[0].logprobs, base[0].outputs[0].token_ids):
        chosen = entry[token]
        assert isinstance(chosen, float) and chosen.logprob == float(chosen) and chosen.rank == 1  # greedy
        alternatives = sorted((v for t, v in entry.items()), key=lambda v: v.rank)
        assert [v.rank for v in alternatives] == [1, 2] and alternatives[0] >= alternatives[1]
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in entry.items())
        assert pickle.loads(pickle.dumps(entry)) == entry and json.loads(json.dumps(entry)) == {
            str(t): float(v) for t, v in entry.items()}
    sampled = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=3, max_tokens=24, logprobs=0),
                           use_tqdm=False)[0].outputs[0]
    ranks = [entry[token].rank for entry, token in zip(sampled.logprobs, sampled.token_ids)]
    assert all(r >= 1 for r in ranks) and max(ranks) > 1  # a sampled token is not always the likeliest
    prompt = llm.generate(PROMPTS[0], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert all(v.decoded_token == tokenizer.decode([t]) and v.rank >= 1
               for entry in prompt.prompt_logprobs[1:] for t, v in entry.items())
    first = base[0].outputs[0]
    by_token = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[first.token_ids[2]]),
                            use_tqdm=False)[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", first.token_ids[2])
    stop = first.text[len(first.text) // 2:][:3]
    by_string = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop]),
                             use_tqdm=False)[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", stop)
    by_eos = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, logit_bias={EOS: 100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert (by_eos.finish_reason, by_eos.stop_reason) == ("stop", None)


def test_the_fields_match_transformers_generate(llm):
    """The same checkpoint run by transformers' generate with its logits processors gives the same tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llm.config.model.path, dtype=torch.float32)
    tokenizer = llm.get_tokenizer()
    bias = {137: -100.0, 403: 3.0}
    ours = greedy(llm, repetition_penalty=1.4, min_tokens=20, logit_bias=bias)
    for prompt, tokens in zip(PROMPTS, ours):
        ids = torch.tensor([tokenizer.encode(prompt)])
        out = model.generate(ids, do_sample=False, max_new_tokens=24, repetition_penalty=1.4, min_new_tokens=20,
                             eos_token_id=EOS, sequence_bias=[[[t], b] for t, b in bias.items()],
                             pad_token_id=EOS)
        assert out[0, ids.shape[1]:].tolist() == tokens


SPEC_FIELDS = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2, min_tokens=6,
                   logit_bias={EOS: 50.0})


@pytest.mark.parametrize("drafter", ["ngram", "draft model", "mtp"])
def test_speculation_stays_exact_with_the_fields(llm, checkpoints, drafter):
    """Greedy with penalties, min_tokens, logit_bias (and bad_words where the model has a tokenizer): the tokens
    of plain decoding, with drafts verified; sampled, min_tokens still holds EOS back."""
    fields = dict(SPEC_FIELDS)
    if drafter == "mtp":  # DeepSeek-V3 attention with one MTP layer (tests/test_spec_decode.py), no tokenizer
        from test_spec_decode import MTP, MTP_FILE, add_mtp_layer, tiny_mla_config

        model = checkpoints("spec-mla", tiny_mla_config())
        if not (model / MTP_FILE).exists():
            add_mtp_layer(model, tiny_mla_config())
        model, speculative_config = str(model), MTP
        plain = LLM(model, **ENGINE)
        try:
            want = greedy(plain, prompts=[[0, 5, 9, 5, 9], [0, 7, 7, 7]], **fields)
        finally:
            plain.engine.shutdown()
    else:
        fields["bad_words"] = ["back"]  # two tokens; " back" is one, a different length: left alone, as vLLM
        fields["logit_bias"] = {EOS: 50.0, 137: 1.0}  # "The cat" goes on repeating 137: n-gram drafts
        model = MODEL
        speculative_config = NGRAM if drafter == "ngram" else {"model": MODEL, "num_speculative_tokens": 3}
        want = greedy(llm, **fields)
    speculative = LLM(model, speculative_config=speculative_config, **ENGINE)
    try:
        prompts = PROMPTS if drafter != "mtp" else [[0, 5, 9, 5, 9], [0, 7, 7, 7]]
        assert greedy(speculative, prompts=prompts, **fields) == want
        assert speculative.engine.spec_num_draft_tokens > 0  # drafts were verified, not just skipped
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=24, **fields)
        sampled = speculative.generate(prompts, params, use_tqdm=False)
        assert all(EOS not in o.outputs[0].token_ids[:6] for o in sampled)
    finally:
        speculative.engine.shutdown()



@pytest.mark.parametrize("penalty", [1e-300, 1e-30])
def test_a_repetition_penalty_near_zero_keeps_the_distribution_finite(llm, penalty):
    """Before: a repetition_penalty near 0 (valid: it must only be > 0) divided a repeated token's positive logit
    into inf, the softmax made NaN of it, and the request failed with torch's "probability tensor contains
    either inf, nan or element < 0". Now penalised logits stay finite (at most float32's largest): such a penalty
    puts the mass on the repeated tokens of positive logit, sampled or greedy."""
    for params in (SamplingParams(temperature=0.7, seed=3, max_tokens=12, repetition_penalty=penalty),
                   SamplingParams(temperature=0, max_tokens=12, repetition_penalty=penalty)):
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            completion = output.outputs[0]
            assert output.error is None and completion.finish_reason in ("length", "stop"), output
            assert len(completion.token_ids) >= 1

def test_bad_words_and_logit_bias_need_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 512\)"):
        llm.generate(["Hi"], SamplingParams(logit_bias={512: 1.0}), use_tqdm=False)
    # before: accepted offline (the server refused them), a stop token that can never come
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 512\), got 600"):
        llm.generate(["Hi"], SamplingParams(stop_token_ids=[3, 600]), use_tqdm=False)
    SamplingParams(skip_special_tokens=True, spaces_between_special_tokens=True, detokenize=True)  # vLLM's defaults


# --- the OpenAI routes -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    server = OpenAIServer(LLMEngine(EngineArgs.from_kwargs(MODEL, **ENGINE).create_engine_config()), [MODEL])
    with TestClient(server.app) as test_client:
        yield test_client


def post(client: TestClient, route: str, **body):
    if route == "chat":
        return client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": "The cat"}],
                                                         **body})
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "The cat", **body})


UNSUPPORTED = [("use_beam_search", True), ("best_of", 3), ("length_penalty", 0.5), ("early_stopping", True),
               ("prompt_logprobs", 1), ("skip_special_tokens", False),
               ("spaces_between_special_tokens", False), ("truncate_prompt_tokens", 4), ("allowed_token_ids", [5]),
               ("logits_processors", ["x"]),
               ("return_tokens_as_token_ids", True), ("use_beam_search", 1)]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_fields_kvshard_does_not_implement_are_refused(client, route):
    for field, value in UNSUPPORTED:
        response = post(client, route, **{field: value})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field and "not supported" in response.json()["error"]["message"]
    # their no-op values are fine
    fine = post(client, route, max_tokens=2, use_beam_search=False, length_penalty=1.0, best_of=1,
                skip_special_tokens=True, include_stop_str_in_output=False)
    assert fine.status_code == 200, fine.text


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_structured_output_fields_are_served_and_checked(client, route):
    # vLLM's constraint fields (and the removed guided_* aliases): a good one is served, a bad one a 400 naming it
    for field, value in [("guided_regex", "a+"), ("guided_choice", ["a", "b"]), ("structured_outputs", {"regex": "a"}),
                         ("guided_json", {"type": "object"})]:
        response = post(client, route, max_tokens=2, **{field: value})
        assert response.status_code == 200, (field, response.text)
    for field, value in [("guided_json", {}), ("guided_regex", "("), ("guided_choice", []), ("guided_grammar", "x"),
                         ("structured_outputs", {"regex": "a", "choice": ["a"]})]:
        response = post(client, route, max_tokens=2, **{field: value})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field, (field, response.text)


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("field, value", [("min_p", 2), ("repetition_penalty", 0), ("presence_penalty", 3),
                                          ("frequency_penalty", -2.5), ("min_tokens", -1), ("min_tokens", 100),
                                          ("logit_bias", {"a": 1}), ("logit_bias", {"-1": 1}),
                                          ("logit_bias", {"5": 200}), ("logit_bias", {"512": 1}),
                                          ("logit_bias", {"5": "x"}), ("bad_words", [""]), ("bad_words", "cat")])
def test_invalid_sampling_values_get_400_naming_the_field(client, route, field, value):
    response = post(client, route, max_tokens=16, **{field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.text


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_settings_that_leave_no_token_get_a_400_saying_so(client, route, stream, temperature):
    # the constraint can only end after "yes", and min_tokens holds the end back: no token is left
    response = post(client, route, max_tokens=8, min_tokens=6, temperature=temperature, stream=stream,
                    structured_outputs={"choice": ["yes"]})
    if not stream:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    else:  # the stream has begun: the error comes as its last event before [DONE]
        assert response.status_code == 200, response.text
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in events[-2], events
        import json
        error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and NO_TOKEN_LEFT in error["message"], error
    assert post(client, route, max_tokens=2).status_code == 200  # the server serves on


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_routes_apply_the_fields(client, route):
    def tokens(response) -> list[int]:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        entries = choice["logprobs"]["content"] if route == "chat" else choice["logprobs"]["tokens"]
        return [e["token"] if route == "chat" else e for e in entries]

    logprobs = {"logprobs": True} if route == "chat" else {"logprobs": 0}
    base = post(client, route, temperature=0, max_tokens=12, **logprobs)
    first = tokens(base)[0]
    biased = post(client, route, temperature=0, max_tokens=12, logit_bias={"1": 100}, min_tokens=3, **logprobs)
    assert len(tokens(biased)) == 4  # EOS at the top, held back for three tokens
    banned = post(client, route, temperature=0, max_tokens=12, bad_words=[first.strip()], **logprobs)
    assert first not in tokens(banned) and tokens(banned) != tokens(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_tokens_are_argmax_with_ties_infinities_and_nans(dtype):
    # the greedy rows' tokens: argmax's, the first of tied maxima, a row of -inf its first token, a NaN the largest
    g = torch.Generator().manual_seed(4)
    for trial in range(50):
        logits = torch.randint(-3, 3, (16, 97), generator=g).to(dtype)  # small integers: many ties
        logits[2] = float("-inf")
        if trial % 2:
            logits[3, 7] = logits[3, 50] = float("nan")
            logits[4] = float("nan")
        expected = logits.argmax(dim=-1).tolist()
        assert greedy_tokens(logits) == expected
        assert expected[2] == 0 and (not trial % 2 or (expected[3] == 7 and expected[4] == 0))
    wide = torch.randn(32, 49152, generator=g).to(dtype)
    wide[:, 100] = wide[:, 40000] = wide.max()
    assert greedy_tokens(wide) == [100] * 32


@pytest.mark.parametrize("width", [1, 15, 16, 17, 97, 4096, 49152])
def test_the_extensions_argmax_gives_torchs_indices(width, fused_ops):
    """`row_argmax` (the greedy tokens of float32 logits on a CPU) against its oracle, torch's `max(dim=-1)`:
    ties (small integers), rows of -inf, a NaN in the first sixteen, in a later block after the maximum, in the
    tail past the last block, several NaNs, and rows that are views into wider ones (a row stride past V)."""
    g = torch.Generator().manual_seed(width)
    for trial in range(20):
        wider = torch.randint(-4, 4, (9, width + 5), generator=g).float()
        if trial % 3 == 0:
            wider = torch.randn(9, width + 5, generator=g)
        logits = wider[:, 2:2 + width]  # rows width + 5 apart
        logits[1] = float("-inf")
        spots = torch.randint(0, width, (6,), generator=g).tolist()
        logits[2, spots[0]] = float("nan")
        logits[3, min(width - 1, 16 + spots[1] % 64)] = float("nan")
        logits[4, width - 1] = float("nan")
        logits[5, spots[2]] = logits[5, spots[3]] = float("nan")
        logits[6, spots[4]] = float("inf")
        logits[7, spots[5]] = logits.max() + 1  # one clear maximum anywhere
        assert fused_ops.row_argmax(logits).tolist() == logits.max(dim=-1).indices.tolist(), trial
        assert greedy_tokens(logits) == logits.max(dim=-1).indices.tolist()
    assert fused_ops.row_argmax(torch.empty(0, width)).tolist() == []
    with pytest.raises(RuntimeError, match="row_argmax"):
        fused_ops.row_argmax(torch.zeros(2, width, dtype=torch.bfloat16))
