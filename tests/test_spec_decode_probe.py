"""Speculative decoding as a server answers with it: greedy output of the n-gram method token for token that of
the same engine without speculation, over /v1/completions and /v1/chat/completions, streamed or not, with stop
strings and stop tokens met inside a run of accepted drafts, max_tokens met inside one, logprobs and n > 1; and
the spec-decode counters consistent with what was output (a step gives its request 1 + accepted tokens, also
when a stop ends the request inside the run: the drafts verified past it are not counted as accepted).

The drafter is the n-gram proposer with its lookup replaced by the plain engine's own continuation, every fifth
position changed, so that whole runs are accepted and runs end at every draft position whatever the random
weights of the demo model. Two small engines at tp=1, kept for the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvshard import LLM, SamplingParams
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.entrypoints.openai_server import OpenAIServer
from server_harness import stream_events

MODEL = "kvshard-demo-gqa"
BLOCK = 4
K = 3  # drafts per step
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ENGINE = dict(max_model_len=256, kv_cache_memory="16MiB", block_size=BLOCK)
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
ATOL = 1e-4
EOS = 1  # the demo models' eos_token_id


class ReferenceDrafts:
    """Drafts the continuation the plain engine gave (every output it finished is recorded), with every
    `every`-th position of the sequence changed (0: none), so that runs are accepted and rejected; none for
    tokens it has no continuation of."""

    def __init__(self, every: int = 5) -> None:
        self.sequences: list[list[int]] = []
        self.every = every

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        n = len(token_ids)
        for full in self.sequences:
            if len(full) > n and full[:n] == token_ids:
                drafts = full[n : n + max_drafts]
                if self.every:
                    drafts = [t if (n + j) % self.every != self.every - 1 else (t + 1) % 512
                              for j, t in enumerate(drafts)]
                return drafts
        return []


def record_outputs(engine: LLMEngine, drafts: ReferenceDrafts) -> None:
    """Every sequence the plain `engine` finishes (prompt and output) becomes a continuation to draft."""
    output = engine.output_processor.output

    def recording(request):
        result = output(request)
        if result.finished:
            drafts.sequences += [list(result.prompt_token_ids) + list(c.token_ids) for c in result.outputs]
        return result

    engine.output_processor.output = recording


# --- the counters: engine level, every step counted ---------------------------------------------------

@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[LLM, LLM]]:
    with LLM(MODEL, **ENGINE) as plain, LLM(MODEL, speculative_config=NGRAM, **ENGINE) as spec:
        yield plain, spec


def run_counted(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams):
    """One request alone: its final output, the steps that gave it tokens, and the counters' increments."""
    engine = llm.engine
    before = engine.stats()
    engine.add_request(request_id, prompt, params)
    steps, final = 0, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == request_id
            steps += 1
            final = output
    after = engine.stats()
    counted = {name: getattr(after, name) - getattr(before, name) for name in
               ("generation_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens")}
    counted["per_pos"] = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                                 before.spec_decode_num_accepted_tokens_per_pos)]
    return final, steps, counted


def assert_counters_match(output, steps: int, counted: dict) -> None:
    tokens = len(output.outputs[0].token_ids)
    assert counted["generation_tokens"] == tokens
    # each step gives its request its token and the drafts it accepted
    assert tokens == steps + counted["spec_decode_num_accepted_tokens"], counted
    assert counted["spec_decode_num_accepted_tokens"] <= counted["spec_decode_num_draft_tokens"]
    assert sum(counted["per_pos"]) == counted["spec_decode_num_accepted_tokens"]
    assert counted["spec_decode_num_drafts"] <= steps


@pytest.mark.parametrize("stop_kind", ["stop string", "stop token"])
def test_a_stop_inside_an_accepted_run_counts_only_the_drafts_output(engines, monkeypatch, stop_kind):
    """Every draft is the plain continuation, so each step after the prefill accepts all K; a stop met on a
    draft of a run ends the request there, with the tokens of plain decoding, and the counters count the
    drafts before it only. Before, the drafts verified past the stop counted as accepted too, so that
    generated tokens fell short of steps + accepted."""
    plain, spec = engines
    prompt = plain.get_tokenizer().encode(PROMPT)
    greedy = dict(temperature=0, max_tokens=24, ignore_eos=True)
    reference = plain.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    full = prompt + reference
    drafts = ReferenceDrafts(every=0)
    drafts.sequences.append(full)
    monkeypatch.setattr(spec.engine.proposer, "propose", drafts.propose)
    tokenizer = spec.get_tokenizer()
    met = []
    # the prefill gives token 0; each step then verifies K drafts: tokens 1..K of a run of K + 1 are drafts
    for j in range(1, len(reference) - 1):
        if j % (K + 1) == 0:
            continue  # the token after a run, not a draft
        if stop_kind == "stop token":
            if reference[j] in reference[:j]:
                continue
            fields = dict(stop_token_ids=[reference[j]])
        else:
            text = tokenizer.decode(reference[: j + 1], skip_special_tokens=True)
            stop = text[-2:]
            if "\ufffd" in stop or not stop.strip() or stop in tokenizer.decode(reference[:j], skip_special_tokens=True):
                continue
            fields = dict(stop=[stop])
        params = SamplingParams(**greedy, **fields)
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        if want.finish_reason != "stop" or len(want.token_ids) != j + 1:
            continue
        got, steps, counted = run_counted(spec, f"{stop_kind}-{j}", prompt, params)
        assert got.outputs[0].token_ids == want.token_ids and got.outputs[0].text == want.text
        assert got.outputs[0].finish_reason == "stop"
        assert counted["spec_decode_num_drafts"] > 0
        assert_counters_match(got, steps, counted)
        met.append(j % (K + 1))
    assert met and min(met) < K, f"no stop met on a draft before a run's last one: {met}"
    assert spec.engine.stats().kv_blocks_used == 0


def test_max_tokens_inside_a_run_stops_exactly_and_counts_match(engines, monkeypatch):
    plain, spec = engines
    prompt = plain.get_tokenizer().encode(PROMPT)
    reference = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].token_ids
    drafts = ReferenceDrafts()
    drafts.sequences.append(prompt + reference)
    monkeypatch.setattr(spec.engine.proposer, "propose", drafts.propose)
    for max_tokens in (2, 3, 6, 7, 11):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got, steps, counted = run_counted(spec, f"max-{max_tokens}", prompt, params)
        assert got.outputs[0].token_ids == want.token_ids == reference[:max_tokens]
        assert got.outputs[0].finish_reason == "length"
        for mine, theirs, token in zip(got.outputs[0].logprobs, want.logprobs, want.token_ids):
            assert mine.keys() == theirs.keys() and abs(mine[token] - theirs[token]) <= ATOL
        assert_counters_match(got, steps, counted)
    assert spec.engine.stats().kv_blocks_used == 0


# --- over HTTP: both routes, streamed or not ---------------------------------------------------------

@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient, LLMEngine]]:
    plain = LLMEngine(EngineArgs.from_kwargs(MODEL, **ENGINE).create_engine_config())
    spec = LLMEngine(EngineArgs.from_kwargs(MODEL, speculative_config=NGRAM, **ENGINE).create_engine_config())
    drafts = ReferenceDrafts()
    record_outputs(plain, drafts)
    lookup = spec.proposer.propose
    spec.proposer.propose = lambda token_ids, k: drafts.propose(token_ids, k) or lookup(token_ids, k)
    with TestClient(OpenAIServer(plain, [MODEL]).app) as plain_client, \
            TestClient(OpenAIServer(spec, [MODEL]).app) as spec_client:
        yield plain_client, spec_client, spec


def answer(client: TestClient, route: str, body: dict) -> dict:
    response = client.post(route, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client: TestClient, route: str, body: dict) -> dict:
    """Each choice's text and token logprobs joined over the chunks, its finish reason; the usage."""
    joined: dict = {}
    usage = None
    for event in stream_events(client, route, {"model": MODEL, **body, "stream": True,
                                               "stream_options": {"include_usage": True}}):
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            text = choice.get("text", (choice.get("delta") or {}).get("content")) or ""
            mine = joined.setdefault(choice["index"], {"text": "", "logprobs": [], "finish_reason": None})
            mine["text"] += text
            logprobs = choice.get("logprobs") or {}
            mine["logprobs"] += logprobs.get("token_logprobs") or [c["logprob"] for c in logprobs.get("content", [])]
            mine["finish_reason"] = choice.get("finish_reason") or mine["finish_reason"]
    return {"choices": joined, "completion_tokens": usage["completion_tokens"]}


def whole(reply: dict) -> dict:
    choices = {}
    for choice in reply["choices"]:
        logprobs = choice.get("logprobs") or {}
        choices[choice["index"]] = {
            "text": choice["text"] if "text" in choice else choice["message"]["content"],
            "logprobs": logprobs.get("token_logprobs") or [c["logprob"] for c in logprobs.get("content", [])],
            "finish_reason": choice["finish_reason"]}
    return {"choices": choices, "completion_tokens": reply["usage"]["completion_tokens"]}


def assert_same(got: dict, want: dict) -> None:
    assert got["completion_tokens"] == want["completion_tokens"]
    assert got["choices"].keys() == want["choices"].keys()
    for index, theirs in want["choices"].items():
        mine = got["choices"][index]
        assert (mine["text"], mine["finish_reason"]) == (theirs["text"], theirs["finish_reason"])
        assert mine["logprobs"] == pytest.approx(theirs["logprobs"], abs=ATOL)


COMPLETION = {"prompt": "Paris is the capital of France.", "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("route, base, fields", [
    ("/v1/completions", COMPLETION, {"max_tokens": 24, "logprobs": 3}),
    ("/v1/completions", COMPLETION, {"max_tokens": 7, "logprobs": 1, "n": 2}),
    ("/v1/completions", COMPLETION, {"max_tokens": 24, "presence_penalty": 0.5, "frequency_penalty": 0.4,
                                     "repetition_penalty": 1.3, "logit_bias": {"5": 3.0}}),
    ("/v1/chat/completions", CHAT, {"max_tokens": 20, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", CHAT, {"max_tokens": 13, "min_tokens": 9, "n": 2}),
])
def test_greedy_answers_are_those_without_speculation(clients, route, base, fields):
    plain, spec, engine = clients
    body = {**base, **fields}
    want = whole(answer(plain, route, body))  # the plain engine's answer is also what the drafts continue
    drafted = engine.stats().spec_decode_num_draft_tokens
    assert_same(whole(answer(spec, route, body)), want)
    assert_same(streamed(spec, route, body), want)
    assert_same(streamed(plain, route, body), want)
    assert engine.stats().spec_decode_num_draft_tokens > drafted
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("route, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stop_strings_met_inside_a_run_of_drafts(clients, route, base):
    """Stop strings ending on each of the first tokens of the plain answer: the speculative answer stops on
    the same token, streamed or not, whichever draft of a run it is."""
    plain, spec, engine = clients
    reference = answer(plain, route, {**base, "max_tokens": 16, "logprobs": 0 if "prompt" in base else True})
    choice = reference["choices"][0]
    tokens = (choice["logprobs"]["tokens"] if "prompt" in base
              else [c["token"] for c in choice["logprobs"]["content"]])
    stopped = 0
    for j in range(1, 12):
        text = "".join(tokens[: j + 1])
        stop = text[-2:]
        if "\ufffd" in stop or not stop.strip() or stop in "".join(tokens[:j]):
            continue
        body = {**base, "max_tokens": 16, "stop": [stop]}
        want = whole(answer(plain, route, body))
        stopped += want["choices"][0]["finish_reason"] == "stop"
        assert_same(whole(answer(spec, route, body)), want)
        assert_same(streamed(spec, route, body), want)
    assert stopped >= 2
    assert engine.stats().kv_blocks_used == 0


# --- drafts under an output constraint --------------------------------------------------------------------------

def test_a_draft_model_drafts_what_the_constraint_allows(engines, capfd):
    """Before: a draft model drafted from its unconstrained logits, so under a grammar its drafts were the tokens
    the grammar forbids wherever the target's masked choice differed, and verification rejected them. Now each
    draft is drawn from what the request's grammar allows after the output and the drafts before it. The target
    itself as its draft model shows it whole: greedy, its masked choices are the target's, so every draft is
    accepted but where the output ends; and the output stays the tokens of plain decoding under the constraint."""
    from kvshard.sampling_params import StructuredOutputsParams

    plain, _ = engines
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
    params = SamplingParams(temperature=0, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    prompts = [PROMPT, "Hello", "A"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(MODEL, speculative_config={"model": MODEL, "num_speculative_tokens": K}, **ENGINE) as drafted:
        got = drafted.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        for output in got:  # the constraint held: whole JSON of the schema's shape
            assert output.outputs[0].finish_reason == "stop", output.outputs[0]
            assert json.loads(output.outputs[0].text).keys() == {"name", "ok"}
        engine = drafted.engine
        drafts, accepted = engine.spec_num_draft_tokens, sum(engine.spec_accepted_per_pos)
        # a request's last step may draft past its end (its stop token, or max_tokens): those alone are lost
        assert drafts > 0 and drafts - accepted <= K * len(prompts), (drafts, accepted)
    # drafts after a drafted stop token are not offered to the ended grammar (xgrammar warns on stderr)
    assert "terminated after accepting the stop token" not in capfd.readouterr().err


def test_drafts_that_end_the_constraint_are_verified(engines, monkeypatch):
    """Drafts that run to the constraint's end (its stop token drafted, rows after it): before, the row after a
    drafted stop token asked the ended grammar for a mask, and xgrammar raises there, failing the request.
    Every draft here is the plain engine's constrained continuation, the stop token included, at every place
    in a run of K; the outputs are plain decoding's, every request met the end inside a run of drafts."""
    from kvshard.sampling_params import StructuredOutputsParams

    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "maybe so", "not at all"]))
    prompts = [PROMPT, "Hello", "A", "B", "The quick"]
    tokenizer = plain.get_tokenizer()
    wanted = plain.generate(prompts, params, use_tqdm=False)
    drafts = ReferenceDrafts(every=0)
    for prompt, output in zip(prompts, wanted):
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].token_ids[-1] == EOS, output
        drafts.sequences.append(tokenizer.encode(prompt) + list(output.outputs[0].token_ids))
    monkeypatch.setattr(spec.engine.proposer, "propose", drafts.propose)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in wanted]
    assert [o.outputs[0].finish_reason for o in got] == ["stop"] * len(prompts)
    # the stop token was a draft (not the token after a run) for some request: the case above was met
    assert any(len(o.outputs[0].token_ids) % (K + 1) != 1 for o in wanted), [len(o.outputs[0].token_ids)
                                                                          for o in wanted]
