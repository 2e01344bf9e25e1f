"""Two of vLLM's server behaviours that clients of kvshard rely on.

1. A request body's top-level fields that its route does not take are ignored, as vLLM ignores them, and named in
   one warning per request in the server's log (route first, names sorted), so that a misspelt `max_token` is found;
   the request is served as it would be without them. Known fields, kvshard's aliases of vLLM's removed fields and
   pydantic aliases are never named.
2. The API key comes from `--api-key`, else $KVSHARD_API_KEY, else vLLM's $VLLM_API_KEY; an empty one, given or set,
   stops the start-up with one line naming the flag or the variable.

One server in this process (`kvshard-demo-gqa`, one rank, fastapi's TestClient), started through `kvshard serve`'s
own argument handling with only $VLLM_API_KEY set (the step that would start the ranks and uvicorn replaced by one
that builds the server in this process), so every request below carries that key.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from fastapi.testclient import TestClient
from pydantic import Field

from conftest import refused
from kvshard.engine.llm_engine import LLMEngine
from kvshard.entrypoints import serve
from kvshard.entrypoints.cli import main
from kvshard.entrypoints.openai.protocol import (MAX_NAMED_FIELDS, ChatCompletionRequest, CompletionRequest,
                                                 _parse, _RequestBody, unknown_fields_message)
from kvshard.entrypoints.openai_server import OpenAIServer
from kvshard.errors import ConfigError

MODEL = "kvshard-demo-gqa"
SMALL = ["--max-model-len", "256", "--kv-cache-memory", "16MiB", "--port", "0"]
KEY = "vllm-env-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LOGGER = "kvshard.server"
KEY_VARIABLES = ("KVSHARD_API_KEY", "VLLM_API_KEY")


def started(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """`kvshard serve ARGV` up to the ranks' start: what it would serve with (config, names, api_key)."""
    seen: dict[str, Any] = {}

    def record(config, master, listener, names, api_key, kv_transfer_config, args):
        listener.close()
        seen.update(config=config, names=names, api_key=api_key)
        return 0

    monkeypatch.setattr(serve, "_serve", record)
    assert main(["serve", *argv]) == 0
    return seen


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("KVSHARD_API_KEY", raising=False)
        patch.setenv("VLLM_API_KEY", KEY)
        seen = started([MODEL, *SMALL], patch)
    assert seen["api_key"] == KEY
    server = OpenAIServer(LLMEngine(seen["config"]), seen["names"], seen["api_key"])
    with TestClient(server.app, headers=AUTH) as test_client:
        yield test_client


@pytest.fixture
def no_key_in_env(monkeypatch):
    for name in KEY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def post(client: TestClient, caplog, route: str, body: dict) -> tuple[dict, list[str]]:
    """The route's answer to `body` (which must be a 200) and the warnings logged while it was served."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        answer = client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    return answer.json(), warnings_of(caplog)


# --- 1. unknown fields ----------------------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "The capital of France", "max_tokens": 6, "temperature": 0.0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0.0}
RESPONSE = {"model": MODEL, "input": "Hello", "max_output_tokens": 6, "temperature": 0.0, "store": False}


def test_an_unknown_completions_field_is_named_and_the_answer_is_unchanged(client, caplog):
    plain, quiet = post(client, caplog, "/v1/completions", COMPLETION)
    assert quiet == []
    # a misspelt max_tokens (the request keeps its max_tokens: 6) and a field kvshard does not know
    odd, logged = post(client, caplog, "/v1/completions", {**COMPLETION, "max_token": 2, "zz_custom": {"a": [1]}})
    assert logged == ["POST /v1/completions: ignored the request's unknown fields 'max_token', 'zz_custom' "
                      "(not taken by this route: check the spelling)"]
    assert [c["text"] for c in odd["choices"]] == [c["text"] for c in plain["choices"]]
    assert odd["usage"] == plain["usage"] and plain["usage"]["completion_tokens"] == 6


def test_an_unknown_chat_field_is_named_once_streamed_or_not_and_the_answer_is_unchanged(client, caplog):
    plain, _ = post(client, caplog, "/v1/chat/completions", CHAT)
    # OpenAI's deprecated `functions` is one of them (docs/serving.md: ignored, as any unknown field)
    odd, logged = post(client, caplog, "/v1/chat/completions", {**CHAT, "functions": [], "verbosity": "low"})
    assert len(logged) == 1 and logged[0].startswith("POST /v1/chat/completions: ")
    assert "unknown fields 'functions', 'verbosity' " in logged[0]
    assert odd["choices"][0]["message"] == plain["choices"][0]["message"]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        streamed = client.post("/v1/chat/completions", json={**CHAT, "stream": True, "verbosity": "low"})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert warnings_of(caplog) == ["POST /v1/chat/completions: ignored the request's unknown field 'verbosity' "
                                   "(not taken by this route: check the spelling)"]


def test_an_unknown_responses_field_is_named_and_the_answer_is_unchanged(client, caplog):
    plain, quiet = post(client, caplog, "/v1/responses", RESPONSE)
    assert quiet == []
    odd, logged = post(client, caplog, "/v1/responses", {**RESPONSE, "service_tier": "auto", "max_tokens": 2})
    assert len(logged) == 1 and logged[0].startswith("POST /v1/responses: ")
    assert "unknown fields 'max_tokens', 'service_tier' " in logged[0]
    assert odd["output"][0]["content"] == plain["output"][0]["content"] and odd["usage"] == plain["usage"]


def test_unknown_tokenize_and_detokenize_fields_are_named(client, caplog):
    tokens, logged = post(client, caplog, "/tokenize", {"model": MODEL, "prompt": "Hello there", "text": "x"})
    assert len(logged) == 1 and logged[0].startswith("POST /tokenize: ") and "'text'" in logged[0]
    assert tokens["tokens"] == post(client, caplog, "/tokenize", {"model": MODEL, "prompt": "Hello there"})[0]["tokens"]
    text, logged = post(client, caplog, "/detokenize", {"tokens": tokens["tokens"], "skip_special_tokens": True})
    assert len(logged) == 1 and logged[0].startswith("POST /detokenize: ") and "'skip_special_tokens'" in logged[0]
    assert text["prompt"].endswith("Hello there")


def test_known_fields_and_kvshards_aliases_are_not_named(client, caplog):
    known = {**COMPLETION, "n": 1, "top_p": 1.0, "top_k": -1, "seed": 3, "stop": ["\n\n"], "stream": False,
             "logprobs": 1, "echo": False, "best_of": 1, "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0,
             "ignore_eos": False, "include_stop_str_in_output": False, "skip_special_tokens": True,
             "use_beam_search": False, "guided_choice": ["Paris", "Rome"]}  # guided_*: vLLM's removed fields
    # OpenAI's end-user identifiers (the SDKs' `user=`), which vLLM takes without a word, on every route
    identifiers = {"user": "user-1234", "safety_identifier": "h-5678"}
    assert post(client, caplog, "/v1/completions", {**known, **identifiers})[1] == []
    chat = {**CHAT, "max_tokens": None, "max_completion_tokens": 6, "logprobs": True, "top_logprobs": 2,
            "add_generation_prompt": True, "structured_outputs": {"regex": "[a-z]{1,4}"}, "presence_penalty": 0.0,
            "continue_final_message": False}
    assert post(client, caplog, "/v1/chat/completions", {**chat, **identifiers})[1] == []
    # declared Responses fields that are accepted (and checked) rather than unknown
    responses = {**RESPONSE, "metadata": {"k": "v"}, "reasoning": {"effort": "low"}, "include": [],
                 "truncation": "disabled", "parallel_tool_calls": True, "top_p": 1.0, "seed": 1}
    assert post(client, caplog, "/v1/responses", {**responses, **identifiers})[1] == []


@pytest.mark.parametrize("escape", ["\\ud800", "x\\udc00y"])
def test_a_lone_surrogate_escape_is_a_400_that_says_so(client, escape):
    """A body whose string holds a lone surrogate escape (JSON's grammar allows it; it is no character) was refused
    with the parser's "unexpected end of hex escape", which reads as a typo; now the 400 says what is wrong."""
    body = json.dumps(CHAT).replace('"Hello"', f'"{escape}"')
    answer = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("the request body is not valid JSON") and "half of a surrogate pair" in message
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # the server answers on


def test_continue_final_message_leaves_the_last_message_open(client, caplog):
    """vLLM's continue_final_message: the conversation rendered without the end of its last message, so that the
    answer continues it (an agent's prefilled reply); with add_generation_prompt also true, a 400 naming it, on
    /v1/chat/completions and /tokenize alike."""
    messages = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "The city is"}]
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False}
    closed = post(client, caplog, "/tokenize", body)[0]["tokens"]
    open_ = post(client, caplog, "/tokenize", {**body, "continue_final_message": True})[0]["tokens"]
    answer = client.post("/detokenize", json={"tokens": open_}).json()["prompt"]
    assert answer.endswith("The city is") and len(open_) < len(closed) and closed[:len(open_)] == open_
    chat, _ = post(client, caplog, "/v1/chat/completions", {**CHAT, **body, "continue_final_message": True})
    assert chat["usage"]["prompt_tokens"] == len(open_)
    for route in ("/v1/chat/completions", "/tokenize"):
        both = client.post(route, json={**CHAT, "messages": messages, "continue_final_message": True})
        assert both.status_code == 400, both.text
        error = both.json()["error"]
        assert error["param"] == "continue_final_message" and "add_generation_prompt false" in error["message"]


def test_unknown_fields_of_nested_objects_are_ignored_without_a_warning(client, caplog):
    body = {**CHAT, "messages": [{"role": "user", "content": "Hello", "refusal": None}]}
    assert post(client, caplog, "/v1/chat/completions", body)[1] == []


def test_a_refused_request_names_its_error_not_its_unknown_fields(client, caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        answer = client.post("/v1/completions", json={**COMPLETION, "temperature": "hot", "max_token": 2})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "temperature"
    assert warnings_of(caplog) == []


def test_unknown_fields_are_not_kept_with_the_request(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        request = _parse(CompletionRequest, json.dumps({**COMPLETION, "max_token": 2, "seed": 5}).encode())
    assert request.max_tokens == 6 and request.model_extra == {}  # nothing of theirs is kept but the names
    assert request.model_fields_set == {"model", "prompt", "max_tokens", "temperature", "seed"}
    assert request._unknown_fields == ("max_token",)
    # a body built in code (the Responses route's own chat request) is not a client's: nothing is logged for it
    assert ChatCompletionRequest.model_validate(CHAT)._unknown_fields == ()


def test_a_pydantic_alias_is_not_an_unknown_field(caplog):
    class Aliased(_RequestBody):
        ROUTE: ClassVar[str] = "POST /aliased"
        max_tokens: int = Field(1, alias="max_new_tokens")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _parse(Aliased, b'{"max_new_tokens": 4}').max_tokens == 4
    assert warnings_of(caplog) == []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _parse(Aliased, b'{"max_new_tokens": 4, "max_newtokens": 5}')
    assert warnings_of(caplog) == ["POST /aliased: ignored the request's unknown field 'max_newtokens' "
                                   "(not taken by this route: check the spelling)"]


def test_the_warning_quotes_each_name_and_names_a_bounded_number():
    many = tuple(sorted(f"f{i:03d}" for i in range(MAX_NAMED_FIELDS + 5)))
    message = unknown_fields_message(many)
    assert message.count("'f") == MAX_NAMED_FIELDS and " and 5 more " in message
    odd = unknown_fields_message(("a\nb", "x" * 500))
    assert "\n" not in odd and "'a\\nb'" in odd and "x" * 65 not in odd


# --- 2. the API key from the environment ------------------------------------------------------------------------------

def test_vllm_api_key_alone_protects_the_routes(client):
    assert client.get("/health", headers={"Authorization": ""}).status_code == 200
    for method, route in (("get", "/v1/models"), ("post", "/v1/completions"), ("post", "/tokenize")):
        refused_answer = getattr(client, method)(route, headers={"Authorization": ""},
                                                 **({"json": COMPLETION} if method == "post" else {}))
        assert refused_answer.status_code == 401 and refused_answer.json()["error"]["code"] == "invalid_api_key"
        wrong = getattr(client, method)(route, headers={"Authorization": "Bearer other"},
                                        **({"json": COMPLETION} if method == "post" else {}))
        assert wrong.status_code == 401
    assert client.get("/v1/models").status_code == 200  # the client's headers carry $VLLM_API_KEY's key
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


@pytest.mark.parametrize("env, argv, key", [
    ({}, [], None),
    ({"VLLM_API_KEY": "v"}, [], "v"),
    ({"KVSHARD_API_KEY": "k"}, [], "k"),
    ({"KVSHARD_API_KEY": "k", "VLLM_API_KEY": "v"}, [], "k"),  # kvshard's own wins
    ({"KVSHARD_API_KEY": " k "}, [], "k"),  # as every text variable: stripped
    ({"KVSHARD_API_KEY": "k", "VLLM_API_KEY": "v"}, ["--api-key", "flag"], "flag"),  # the flag wins over both
    ({"VLLM_API_KEY": ""}, ["--api-key", "flag"], "flag"),  # and then neither variable is read
    ({"KVSHARD_API_KEY": "k", "VLLM_API_KEY": ""}, [], "k"),  # $VLLM_API_KEY is read only without $KVSHARD_API_KEY
])
def test_the_key_comes_from_the_flag_then_kvshard_api_key_then_vllm_api_key(no_key_in_env, monkeypatch, env, argv,
                                                                            key):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert started([MODEL, *SMALL, *argv], monkeypatch)["api_key"] == key


@pytest.mark.parametrize("env, named", [
    ({"VLLM_API_KEY": ""}, "$VLLM_API_KEY"),
    ({"VLLM_API_KEY": "  "}, "$VLLM_API_KEY"),
    ({"KVSHARD_API_KEY": ""}, "$KVSHARD_API_KEY"),
    ({"KVSHARD_API_KEY": " ", "VLLM_API_KEY": "v"}, "$KVSHARD_API_KEY"),  # the one that would be read is empty
])
def test_an_empty_key_variable_is_refused_at_start_up_by_name(no_key_in_env, no_ranks, monkeypatch, capsys, env,
                                                              named):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refused(capsys, [MODEL, *SMALL], named)
    assert "is set but empty" in line and "no request could match it" in line
    other = next(name for name in KEY_VARIABLES if f"${name}" != named)
    assert other not in line


def test_the_key_function_names_the_flag_or_the_variable(no_key_in_env, monkeypatch):
    assert serve.api_key_arg(None) is None
    with pytest.raises(ConfigError, match=r"^--api-key is empty"):
        serve.api_key_arg(" ")
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(ConfigError, match=r"^\$VLLM_API_KEY is set but empty"):
        serve.api_key_arg(None)
    assert serve.api_key_arg("given") == "given"
