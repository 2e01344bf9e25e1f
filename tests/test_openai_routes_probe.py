"""The OpenAI routes and the offline API as their users use them, where kvshard once differed from OpenAI and vLLM.

One in-process server (tp=1, `kvshard-demo-gqa`, served by uvicorn on a thread so that a client can really hang up)
and one `LLM` of the same model and settings, whose seeded samples are the server's: a stop token's text left out
of the output, the first output token's leading space under SentencePiece decoders, `stream_options` with
`continuous_usage_stats` and `usage: null`, `/metrics` after a client leaves a request some of whose choices had
finished, and `LLM.chat`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import uvicorn

from kvshard import LLM, SamplingParams
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.engine.output_processor import OutputProcessor
from kvshard.engine.sequence import Sequence
from kvshard.entrypoints.openai.serving_engine import with_connection_transport
from kvshard.entrypoints.openai_server import OpenAIServer
from server_harness import free_local_port, scraped_metrics as metrics, uvicorn_on_a_thread

MODEL = "kvshard-demo-gqa"
ENGINE = dict(max_model_len=256, kv_cache_memory="16MiB")
PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def served() -> Iterator[SimpleNamespace]:
    engine = LLMEngine(EngineArgs.from_kwargs(MODEL, **ENGINE).create_engine_config())
    server = OpenAIServer(engine, [MODEL])
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    with uvicorn_on_a_thread(uvicorn.Config(with_connection_transport(server.app), port=port, log_level="warning")), \
            httpx.Client(base_url=url, timeout=60) as http:
        yield SimpleNamespace(url=url, http=http, engine=engine)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM(MODEL, **ENGINE) as engine:
        yield engine


def events(http: httpx.Client, route: str, **body) -> list[dict]:
    response = http.post(route, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    data = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data
    return [json.loads(item) for item in data[:-1]]


def finished(values: dict, reason: str) -> float:
    return values[("kvshard:request_success_total", (("finished_reason", reason),))]


# --- stop tokens and the decoder --------------------------------------------------------------------------------

def test_a_stop_token_ends_the_output_without_its_text(served, llm):
    """As vLLM (OpenAI's "the returned text will not contain the stop sequence"): `stop_token_ids` end the output
    with finish_reason "stop", the token's id kept in token_ids but its text not in the text; the route agrees."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids

    def text(max_tokens: int) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].text

    # a token that is new at its place and adds visible text
    at = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i] and text(i + 1) != text(i))
    stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[tokens[at]])
    out = llm.generate(PROMPT, stop, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == tokens[: at + 1]
    assert out.text == text(at), (out.text, text(at), text(at + 1))

    body = dict(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[tokens[at]])
    whole = served.http.post("/v1/completions", json={"model": MODEL, **body}).json()
    assert whole["choices"][0]["text"] == text(at) and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == at + 1
    chunks = events(served.http, "/v1/completions", stream=True, **body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text(at)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_include_stop_str_in_output_keeps_the_stop_string_and_the_stop_tokens_text(served, llm):
    """vLLM's `include_stop_str_in_output`: the text ends with the stop string (nothing after it) or with the stop
    token's text. Before: the field was ignored, as any unknown one."""
    prompt = "Hello world, this is"  # its greedy answer adds visible text token after token

    def run(max_tokens: int, **fields):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **fields)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    full = run(12)
    # the stop string: the text a token adds in the middle of the greedy answer, found nowhere before it
    at, stop = next((len(run(i).text), run(i + 1).text[len(run(i).text):]) for i in range(2, 11)
                    if (piece := run(i + 1).text[len(run(i).text):]).strip() and piece not in run(i).text)
    assert full.text.find(stop) == at, (full.text, stop)
    out = run(12, stop=[stop], include_stop_str_in_output=True)
    assert (out.text, out.finish_reason) == (full.text[:at + len(stop)], "stop")
    assert run(12, stop=[stop]).text == full.text[:at]

    token = full.token_ids[4]
    out = run(12, stop_token_ids=[token], include_stop_str_in_output=True)
    first = full.token_ids.index(token)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.text == run(first + 1).text

    body = dict(prompt=prompt, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                include_stop_str_in_output=True)
    whole = served.http.post("/v1/completions", json={"model": MODEL, **body}).json()
    assert whole["choices"][0]["text"] == full.text[:at + len(stop)]
    chunks = events(served.http, "/v1/completions", stream=True, **body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full.text[:at + len(stop)]
    refused = served.http.post("/v1/completions", json={"model": MODEL, **body, "include_stop_str_in_output": "yes"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include_stop_str_in_output"


@pytest.mark.parametrize("metaspace", [False, True], ids=["llama2-style", "metaspace"])
def test_the_first_output_token_reads_as_it_does_after_the_prompt(metaspace):
    """SentencePiece decoders drop the leading space at the start of a text: decoded alone, "▁the" is "the".
    The output's text is what it adds to the prompt's (vLLM's), so " the hi" stays " the hi"."""
    from test_logprob_bytes import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer(metaspace)
    prompt = tokenizer.encode("the cat", add_special_tokens=True)
    output = tokenizer.convert_tokens_to_ids(["▁the", "▁hi", "é"])
    processor = OutputProcessor(tokenizer, SimpleNamespace(eos_token_id=tokenizer.eos_token_id), 100)
    seq = Sequence("r", 0, prompt, SamplingParams(max_tokens=10), None)
    for token in output:
        assert processor.append_token(seq, token) is None
    whole = tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert whole.startswith(tokenizer.decode(prompt, skip_special_tokens=True))
    assert seq.text == whole[len(tokenizer.decode(prompt, skip_special_tokens=True)):] == " the hié"


# --- stream_options ---------------------------------------------------------------------------------------------

def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk's usage counts the tokens sent so far (all
    choices), the last chunk (`choices: []`) the whole request's, equal to the non-streamed usage."""
    body = dict(prompt=PROMPT, max_tokens=5, n=2, seed=3, temperature=1.0, ignore_eos=True)
    whole = served.http.post("/v1/completions", json={"model": MODEL, **body}).json()["usage"]
    chunks = events(served.http, "/v1/completions", stream=True, **body,
                    stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert all(isinstance(c.get("usage"), dict) for c in chunks), chunks
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 10
    assert all(c["usage"]["prompt_tokens"] == whole["prompt_tokens"] for c in chunks)
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole

    chat = events(served.http, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                  stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant" and chat[0]["usage"]["completion_tokens"] == 0
    assert [c["usage"]["completion_tokens"] for c in chat] == [0, 1, 2, 3, 3]


def test_include_usage_gives_every_other_chunk_a_null_usage(served):
    """OpenAI: with include_usage, every chunk but the last has `"usage": null`; without it, no usage field."""
    body = dict(messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
    chunks = events(served.http, "/v1/chat/completions", **body, stream_options={"include_usage": True})
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]), chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in events(served.http, "/v1/chat/completions", **body))


# --- a client that leaves ---------------------------------------------------------------------------------------

def test_a_client_leaving_counts_the_choices_that_had_finished_as_they_finished(served, llm):
    """n=2, choice 0 stops at a stop token early while choice 1 runs on; the client hangs up: the request is
    aborted, its KV blocks freed, and /metrics counts one sequence "stop" (what the client was sent) and one
    "abort"."""
    seed, prompt = 11, [10, 20, 30, 40]
    sampled = SamplingParams(n=2, seed=seed, temperature=1.0, max_tokens=200, ignore_eos=True)
    first, second = llm.generate([prompt], sampled, use_tqdm=False)[0].outputs
    stop_at = next(i for i in range(1, 8) if first.token_ids[i] not in first.token_ids[:i] + second.token_ids)
    used_before = served.engine.pool.num_used
    before = metrics(served.http)
    body = {"model": MODEL, "prompt": prompt, "n": 2, "seed": seed, "temperature": 1.0, "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stop_token_ids": [first.token_ids[stop_at]]}
    seen: dict[int, str | None] = {}
    with httpx.Client(base_url=served.url, timeout=60) as client, client.stream("POST", "/v1/completions",
                                                                                  json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: "):])["choices"]:
                seen[choice["index"]] = choice["finish_reason"]
            if seen.get(0) is not None:
                break
    assert seen[0] == "stop" and seen.get(1) is None, seen  # the client left while choice 1 ran
    deadline = time.monotonic() + 10
    while True:
        after = metrics(served.http)
        ended = sum(finished(after, r) - finished(before, r) for r in ("stop", "length", "abort", "error"))
        # the abort is counted as the client leaves, and applied by the engine thread between two steps
        released = served.engine.pool.num_used == 0 and not served.engine.requests
        if (ended >= 2 and released) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert finished(after, "stop") - finished(before, "stop") == 1
    assert finished(after, "abort") - finished(before, "abort") == 1
    assert ended == 2
    assert served.engine.pool.num_used == used_before == 0 and not served.engine.requests


# --- LLM.chat ---------------------------------------------------------------------------------------------------

def test_llm_chat_renders_as_the_chat_route_and_answers_the_same(served, llm):
    """vLLM's `LLM.chat`: one conversation or a list of them, rendered with the template the server uses; greedy,
    the same tokens as /v1/chat/completions, and the same prompt as /tokenize's."""
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [{"type": "text", "text": "The capital of France?"}]}]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (one,) = llm.chat(conversations[0], params, use_tqdm=False)
    both = llm.chat(conversations, params, use_tqdm=False)
    assert one.outputs[0].token_ids == both[0].outputs[0].token_ids
    for conversation, output in zip(conversations, both):
        tokenized = served.http.post("/tokenize", json={"model": MODEL, "messages": conversation}).json()
        assert output.prompt_token_ids == tokenized["tokens"]
        assert isinstance(output.prompt, str) and output.prompt.endswith("<|assistant|>\n")
        reply = served.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": conversation, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        assert reply["choices"][0]["message"]["content"] == output.outputs[0].text
        assert reply["usage"]["prompt_tokens"] == len(output.prompt_token_ids)
    with pytest.raises(ValueError, match="messages.0.content"):
        llm.chat([{"role": "user"}], params, use_tqdm=False)
    # one line naming the field, as the server's 400 does (before: "messages: 1 validation error for ChatTool ...")
    with pytest.raises(ValueError, match=r"^tools\.0\.function: Field required$"):
        llm.chat(conversations[0], params, tools=[{"type": "function"}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\.1\.0\.role: "):
        llm.chat([conversations[0], [{"content": "hi"}]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty"):
        llm.chat([], params, use_tqdm=False)
    # the LLM serves on after a refused conversation
    assert llm.chat(conversations[0], params, use_tqdm=False)[0].outputs[0].token_ids == one.outputs[0].token_ids
    # sampling params as a tuple (any sequence, as vLLM takes), one per prompt
    prompts = ["The capital of France is", "Hello"]
    pair = (SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), params)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts, pair, use_tqdm=False)] == [3, 6]
    # continue_final_message: the last message left open, as the chat route renders it
    prefilled = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city is"}]
    (cont,) = llm.chat(prefilled, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt.endswith("The city is")
    tokenized = served.http.post("/tokenize", json={"model": MODEL, "messages": prefilled, "add_generation_prompt": False,
                                                    "continue_final_message": True}).json()
    assert cont.prompt_token_ids == tokenized["tokens"]
    with pytest.raises(ValueError, match="add_generation_prompt false"):
        llm.chat(prefilled, params, use_tqdm=False, continue_final_message=True)
