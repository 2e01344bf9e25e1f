"""`echo` on /v1/completions, as vLLM and OpenAI's completions API answer it.

Each choice's text is its prompt followed by its output; with `logprobs: N` the choice's logprobs cover the prompt's
tokens first (the first one's logprob and top_logprobs null), from the engine's prompt logprobs. Checked against
transformers' log_softmax over the same weights, against the logprobs the same tokens get when generated (both
routes), through the prefix cache, streamed, for a batch of prompts with n > 1, with `max_tokens: 0` (the prompt
alone, as evaluation harnesses ask for it), and the 400s of what stays refused. One server in this process, on the
GQA demo model (one rank).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.entrypoints.openai.token_bytes import token_bytes
from kvshard.entrypoints.openai_server import OpenAIServer
from kvshard.models.demo import ensure_demo_model
from server_harness import stream_events

MODEL = "kvshard-demo-gqa"
BLOCK = 4  # tokens per KV block: the prompts below span several, which the prefix cache can serve
CHUNK = 16  # tokens per step: a long prompt is prefilled in chunks
# 31 tokens of the demo tokenizer, most of them whole words of its corpus
LONG = ("Decode context parallelism shards the key value cache of every request along the sequence. "
        "Each rank of a group keeps one token in N")
SHORT = "The quick brown fox"
ATOL = 1e-4  # float32 on both sides; different kernels, batch shapes and summation orders


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # lpm: a request's sequence that finds its prompt cached goes before one that computes it for its prompt
    # logprobs, so that a stream's first output can come before the prompt's logprobs are all there
    engine = LLMEngine(EngineArgs.from_kwargs(MODEL, max_model_len=256, kv_cache_memory="16MiB", block_size=BLOCK,
                                              max_num_seqs=8, max_num_batched_tokens=CHUNK,
                                              scheduling_policy="lpm").create_engine_config())
    server = OpenAIServer(engine, [MODEL])
    with TestClient(server.app) as test_client:
        test_client.server = server
        yield test_client


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(ensure_demo_model(MODEL), dtype=torch.float32).eval()


def tokenize(client: TestClient, prompt: str) -> list[int]:
    answer = client.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def complete(client: TestClient, **fields) -> dict:
    answer = client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(client: TestClient, **fields) -> tuple[dict[int, list[dict]], dict | None]:
    """Each choice's chunks in order, and the last chunk's usage."""
    body = {"model": MODEL, "temperature": 0, **fields, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks: dict[int, list[dict]] = {}
    usage = None
    for event in stream_events(client, "/v1/completions", body):
        for choice in event["choices"]:
            chunks.setdefault(choice["index"], []).append(choice)
        usage = event["usage"] or usage
    return chunks, usage


def joined(chunks: list[dict]) -> dict:
    """A choice as one answer from its chunks: text and logprobs concatenated, the last finish_reason."""
    text = "".join(c["text"] for c in chunks)
    logprobs = None
    if chunks[0]["logprobs"] is not None:
        logprobs = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]]
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return {"text": text, "logprobs": logprobs, "finish_reason": chunks[-1]["finish_reason"]}


def reference(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len, V] at every position of `token_ids`, one forward pass."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)


def assert_prompt_part(logprobs: dict, prompt: list[int], want: torch.Tensor, top: int, vocab) -> None:
    """The first len(prompt) entries are the prompt's tokens with transformers' log-probabilities (the first null)."""
    texts = [vocab.raw(t).decode("utf-8", "replace") for t in prompt]
    assert logprobs["tokens"][: len(prompt)] == texts
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for position in range(1, len(prompt)):
        got, alternatives = logprobs["token_logprobs"][position], logprobs["top_logprobs"][position]
        assert got == pytest.approx(want[position - 1, prompt[position]].item(), abs=ATOL), position
        best = want[position - 1].topk(top).indices.tolist()
        names = {vocab.raw(t).decode("utf-8", "replace"): t for t in [*best, prompt[position]]}
        assert set(alternatives) == set(names), position
        for name, token in names.items():
            assert alternatives[name] == pytest.approx(want[position - 1, token].item(), abs=ATOL), (position, name)


def assert_offsets_spell_the_text(choice: dict) -> None:
    """ASCII text: each token's text_offset is where its text stands in the choice's text."""
    text, logprobs = choice["text"], choice["logprobs"]
    assert text.isascii()
    assert logprobs["text_offset"][0] == 0
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert text[offset: offset + len(token)] == token
    assert "".join(logprobs["tokens"]) == text


def vocabulary(client: TestClient):
    server = client.server
    return token_bytes(server.tokenizer, server.vocab_size, getattr(server, "stop_token_ids", None))


# --- exactness ------------------------------------------------------------------------------------------------

def test_echoed_prompt_logprobs_equal_transformers(client, hf_model):
    """lm-evaluation-harness's loglikelihood request: the prompt's logprobs as transformers computes them."""
    prompt = tokenize(client, LONG)
    assert len(prompt) > 6 * BLOCK
    answer = complete(client, prompt=LONG, echo=True, logprobs=3, max_tokens=1)
    choice = answer["choices"][0]
    generated = choice["logprobs"]["tokens"][len(prompt):]
    assert len(generated) == 1 and choice["text"] == LONG + generated[0]
    want = reference(hf_model, prompt)
    vocab = vocabulary(client)
    assert_prompt_part(choice["logprobs"], prompt, want, 3, vocab)
    # the generated token: greedy, the argmax of the last position, with its logprob
    last = want[-1]
    assert generated[0] == vocab.raw(int(last.argmax())).decode("utf-8", "replace")
    assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(last.max().item(), abs=ATOL)
    assert len(choice["logprobs"]["top_logprobs"][-1]) == 3
    assert_offsets_spell_the_text(choice)
    assert choice["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 1,
                               "total_tokens": len(prompt) + 1, "prompt_tokens_details": {"cached_tokens": 0}}

    # token ids and max_tokens 0: the prompt alone, nothing generated
    ids_only = complete(client, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    choice = ids_only["choices"][0]
    assert choice["text"] == LONG and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert_prompt_part(choice["logprobs"], prompt, want, 0, vocab)
    assert ids_only["usage"]["completion_tokens"] == 0 and ids_only["usage"]["prompt_tokens"] == len(prompt)

    # a one-token prompt: its logprob null, nothing else
    alone = complete(client, prompt=prompt[:1], echo=True, logprobs=2, max_tokens=0)["choices"][0]["logprobs"]
    assert (alone["token_logprobs"], alone["top_logprobs"], alone["text_offset"]) == ([None], [None], [0])

    # the official client reads it
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)
    completion = sdk.completions.create(model=MODEL, prompt=SHORT, echo=True, logprobs=1, max_tokens=0)
    assert completion.choices[0].text == SHORT
    assert completion.choices[0].logprobs.token_logprobs[0] is None
    assert completion.usage.completion_tokens == 0


def test_echoed_logprobs_equal_those_of_the_same_tokens_generated(client):
    """A conversation's answer generated (chat and completions give the same tokens and logprobs), then the
    rendered conversation and the answer's tokens echoed: the same logprobs for those tokens, computed in one
    prefill instead of token by token."""
    vocab = vocabulary(client)
    by_bytes = {vocab.raw(t): t for t in range(client.server.vocab_size) if t not in vocab.special}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = client.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True})
    prompt = rendered.json()["tokens"]
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "temperature": 0,
                                                     "max_tokens": 6, "ignore_eos": True, "logprobs": True,
                                                     "top_logprobs": 2})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    ids = [by_bytes[bytes(t["bytes"])] for t in content]
    generated = complete(client, prompt=prompt, max_tokens=6, logprobs=2, ignore_eos=True)["choices"][0]
    assert generated["logprobs"]["tokens"] == [t["token"] for t in content]
    assert generated["logprobs"]["token_logprobs"] == pytest.approx([t["logprob"] for t in content], abs=ATOL)

    echoed = complete(client, prompt=prompt + ids, echo=True, logprobs=2, max_tokens=0)["choices"][0]
    prompt_text = client.server.tokenizer.decode(prompt, skip_special_tokens=True)
    assert echoed["text"] == prompt_text + generated["text"]
    tail = {key: values[len(prompt):] for key, values in echoed["logprobs"].items()}
    assert tail["tokens"] == generated["logprobs"]["tokens"]
    assert tail["token_logprobs"] == pytest.approx(generated["logprobs"]["token_logprobs"], abs=ATOL)
    assert tail["token_logprobs"] == pytest.approx([t["logprob"] for t in content], abs=ATOL)
    for got, want, chat_token in zip(tail["top_logprobs"], generated["logprobs"]["top_logprobs"], content):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=ATOL)
        for alternative in chat_token["top_logprobs"]:
            assert got[alternative["token"]] == pytest.approx(alternative["logprob"], abs=ATOL)
    assert [o - len(prompt_text) for o in tail["text_offset"]] == generated["logprobs"]["text_offset"]


def test_a_cached_prefix_keeps_the_echoed_logprobs_exact(client, hf_model):
    """Prompt logprobs need the prompt's logits: a request that asks for them computes its cached prefix again
    (cached_tokens 0); without logprobs, echo is served from the cache."""
    assert client.post("/reset_prefix_cache").status_code == 200
    prompt = tokenize(client, LONG)
    complete(client, prompt=LONG, max_tokens=1)
    assert complete(client, prompt=LONG, max_tokens=1)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    answer = complete(client, prompt=LONG, echo=True, logprobs=2, max_tokens=2)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_prompt_part(answer["choices"][0]["logprobs"], prompt, reference(hf_model, prompt), 2, vocabulary(client))
    text_only = complete(client, prompt=LONG, echo=True, max_tokens=2)
    assert text_only["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert text_only["choices"][0]["text"] == answer["choices"][0]["text"]
    assert text_only["choices"][0]["logprobs"] is None
    assert text_only["usage"]["prompt_tokens"] == answer["usage"]["prompt_tokens"] == len(prompt)


# --- shapes: batches, n, streams ------------------------------------------------------------------------------

def test_a_batch_of_prompts_with_n_choices(client):
    prompts = [LONG, SHORT]
    lengths = [len(tokenize(client, LONG)), len(tokenize(client, SHORT))]
    answer = complete(client, prompt=prompts, n=2, echo=True, logprobs=1, max_tokens=3, temperature=1.0, seed=7)
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    generated = 0
    for choice in choices:
        prompt_index = choice["index"] // 2
        text, logprobs = choice["text"], choice["logprobs"]
        assert text.startswith([LONG, SHORT][prompt_index])
        count = len(logprobs["tokens"]) - lengths[prompt_index]
        assert 1 <= count <= 3
        generated += count
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(v is not None for v in logprobs["token_logprobs"][1:])
    for first, second in (choices[0:2], choices[2:4]):  # one prompt's choices share its logprobs
        size = lengths[first["index"] // 2]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert first["logprobs"][key][:size] == second["logprobs"][key][:size]
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(lengths) and usage["completion_tokens"] == generated
    assert usage["total_tokens"] == sum(lengths) + generated


def test_streamed_echo_begins_each_choice_with_its_prompt(client):
    ids = tokenize(client, SHORT)
    prompts = [tokenize(client, LONG), ids]  # token ids: echoed as their text
    lengths = [len(prompts[0]), len(ids)]
    fields = dict(prompt=prompts, n=2, echo=True, logprobs=2, max_tokens=4, ignore_eos=True)
    whole = complete(client, **fields)
    chunks, usage = streamed(client, **fields)
    assert sorted(chunks) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        index = choice["index"]
        first = chunks[index][0]
        assert first["text"] == [LONG, SHORT][index // 2] and first["finish_reason"] is None
        assert len(first["logprobs"]["tokens"]) == lengths[index // 2]
        assert first["logprobs"]["token_logprobs"][0] is None
        assert joined(chunks[index]) == {key: choice[key] for key in ("text", "logprobs", "finish_reason")}
    assert usage == whole["usage"]
    assert usage["completion_tokens"] == 4 * 4
    # each choice's output goes on from its own prompt's text: as without echo, shifted by the prompt's length
    plain = complete(client, **{**fields, "echo": False})
    for choice, alone in zip(whole["choices"], plain["choices"]):
        size, prompt_text = lengths[choice["index"] // 2], [LONG, SHORT][choice["index"] // 2]
        assert choice["text"] == prompt_text + alone["text"]
        tail = {key: values[size:] for key, values in choice["logprobs"].items()}
        assert [o - len(prompt_text) for o in tail["text_offset"]] == alone["logprobs"]["text_offset"]
        assert tail["tokens"] == alone["logprobs"]["tokens"]
        assert tail["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=ATOL)
        for got, want in zip(tail["top_logprobs"], alone["logprobs"]["top_logprobs"]):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=ATOL)

    # max_tokens 0: the prompt, then the end
    chunks, usage = streamed(client, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert [c["text"] for c in chunks[0]] == [SHORT, ""]
    assert chunks[0][-1]["finish_reason"] == "length"
    assert len(joined(chunks[0])["logprobs"]["tokens"]) == len(ids)
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(ids)

    # n=2 with the prompt cached: the second sequence samples while the first still computes the prompt's
    # logprobs (chunked); each choice's first chunk waits for all of them
    assert client.post("/reset_prefix_cache").status_code == 200
    complete(client, prompt=LONG, max_tokens=1)
    fields = dict(prompt=LONG, n=2, echo=True, logprobs=1, max_tokens=3, ignore_eos=True)
    chunks, usage = streamed(client, **fields)
    whole = complete(client, **fields)
    for choice in whole["choices"]:
        assert len(chunks[choice["index"]][0]["logprobs"]["tokens"]) == lengths[0]
        assert joined(chunks[choice["index"]])["logprobs"] == choice["logprobs"]
    assert usage == {**whole["usage"], "prompt_tokens_details": usage["prompt_tokens_details"]}

    # echo without logprobs
    chunks, _ = streamed(client, prompt=SHORT, echo=True, max_tokens=3)
    assert chunks[0][0]["text"] == SHORT and chunks[0][0]["logprobs"] is None
    assert joined(chunks[0])["text"] == complete(client, prompt=SHORT, echo=True, max_tokens=3)["choices"][0]["text"]


# --- what stays refused ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),  # without echo
    ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ({"echo": True, "best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"),
    ({"echo": True, "suffix": "x"}, "suffix"),
    ({"echo": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "kv_transfer_params": {"do_remote_prefill": True}}, "echo"),
    ({"echo": "yes"}, "echo"),
])
def test_what_stays_refused_is_a_400_naming_its_field(client, fields, param):
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": SHORT, **fields})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.text
    if fields == {"max_tokens": 0}:
        assert "only with echo" in answer.json()["error"]["message"]
    if param == "prompt_logprobs":  # refused over HTTP, not missing from kvshard: the message says where it is
        assert "over HTTP (the Python API's SamplingParams has it)" in answer.json()["error"]["message"]
