"""Agents' API as a client meets it: tool definitions and tool_choice of the wrong shape, tool schemas that fail,
the Responses API's objects read by the official SDK's own types, and the Responses fields kvshard would
otherwise ignore.

One server in this process (`kvshard-demo-gqa` at tp=1, the hermes parser, fastapi's TestClient running its
lifespan, so that the engine loop runs): every request here is either refused at the door or asks for a few
tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

DEMO = "kvshard-demo-gqa"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client() -> Iterator:
    from fastapi.testclient import TestClient

    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.entrypoints.openai_server import OpenAIServer

    engine = LLMEngine(EngineArgs(model=DEMO, max_model_len=256, kv_cache_memory="16MiB").create_engine_config())
    server = OpenAIServer(engine, [DEMO], enable_auto_tool_choice=True, tool_call_parser="hermes")
    with TestClient(server.app) as test_client:
        yield test_client


def chat(client, **fields):
    return client.post("/v1/chat/completions", json={"model": DEMO, "messages": MESSAGES, "max_tokens": 4,
                                                     "temperature": 0, **fields})


def responses(client, **fields):
    return client.post("/v1/responses", json={"model": DEMO, "max_output_tokens": 4, "temperature": 0, **fields})


def events(client, **fields) -> list[dict]:
    with client.stream("POST", "/v1/responses", json={"model": DEMO, "max_output_tokens": 4, "temperature": 0,
                                                      "stream": True, **fields}) as answer:
        assert answer.status_code == 200, answer.read()
        return [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]


def refused(answer, param: str, *said: str) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for words in said:
        assert words in error["message"], error["message"]
    return error["message"]


# --- the Responses API's objects, as the SDK's types read them --------------------------------------------------

def test_responses_objects_fit_the_sdks_types(client):
    """A response without tool_choice echoes OpenAI's default ("auto"), never null, and its usage has every
    field the SDK's ResponseUsage requires; streamed, each event fits its own event type."""
    from openai.types import responses as types

    event_types = {"response.created": types.ResponseCreatedEvent,
                   "response.in_progress": types.ResponseInProgressEvent,
                   "response.output_item.added": types.ResponseOutputItemAddedEvent,
                   "response.output_item.done": types.ResponseOutputItemDoneEvent,
                   "response.content_part.added": types.ResponseContentPartAddedEvent,
                   "response.content_part.done": types.ResponseContentPartDoneEvent,
                   "response.output_text.delta": types.ResponseTextDeltaEvent,
                   "response.output_text.done": types.ResponseTextDoneEvent,
                   "response.function_call_arguments.delta": types.ResponseFunctionCallArgumentsDeltaEvent,
                   "response.function_call_arguments.done": types.ResponseFunctionCallArgumentsDoneEvent,
                   "response.completed": types.ResponseCompletedEvent,
                   "response.incomplete": types.ResponseIncompleteEvent}
    plain = dict(input="Hello")
    called = dict(input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=40,
                  **COMPACT)
    for request, choice in ((plain, "auto"), (called, "required")):
        answer = responses(client, **request)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["tool_choice"] == choice
        parsed = types.Response.model_validate(body)  # raises on a null tool_choice or a missing usage field
        assert parsed.usage.input_tokens_details.cached_tokens >= 0
        streamed = events(client, **request)
        kinds = [event["type"] for event in streamed]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        for event in streamed:
            event_types[event["type"]].model_validate(event)
        assert streamed[0]["response"]["tool_choice"] == choice
    assert "response.function_call_arguments.delta" in kinds  # the second request's calls were streamed


def test_the_item_the_token_budget_cut_is_incomplete(client):
    """Before: a response cut by max_output_tokens said "incomplete" while the very item it cut said "completed",
    so the item's status told a client nothing. Now the cut item is "incomplete" (OpenAI's), streamed or not, and
    an item the budget did not cut stays "completed"."""
    cut = dict(input="Hello", max_output_tokens=3)
    # cut inside the call's arguments (its name is out: the item is a function call)
    call = dict(input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=36,
                **COMPACT)
    whole = dict(input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=200,
                 parallel_tool_calls=False,
                 **COMPACT)
    for request, kind in ((cut, "message"), (call, "function_call")):
        body = responses(client, **request).json()
        assert body["status"] == "incomplete" and body["output"], body
        assert body["output"][-1]["type"] == kind and body["output"][-1]["status"] == "incomplete", body["output"]
        streamed = events(client, **request)
        done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
        assert streamed[-1]["type"] == "response.incomplete"
        assert done[-1]["status"] == "incomplete", done
        assert streamed[-1]["response"]["output"][-1]["status"] == "incomplete"
    body = responses(client, **whole).json()
    assert body["status"] == "completed" and [item["status"] for item in body["output"]] == ["completed"], body
    streamed = events(client, **whole)
    assert [e["item"]["status"] for e in streamed if e["type"] == "response.output_item.done"] == ["completed"]



def chat_stream_calls(client, **fields) -> tuple[dict[int, dict], str | None]:
    """A streamed chat answer's tool calls, their deltas put together, and its finish_reason."""
    calls: dict[int, dict] = {}
    finish = None
    with client.stream("POST", "/v1/chat/completions", json={"model": DEMO, "messages": MESSAGES, "temperature": 0,
                                                             "stream": True, **fields}) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                finish = choice["finish_reason"] or finish
                for delta in choice["delta"].get("tool_calls") or []:
                    call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
                    call["name"] = delta.get("function", {}).get("name") or call["name"]
                    call["arguments"] += delta.get("function", {}).get("arguments", "")
    return calls, finish


def test_a_call_cut_by_max_tokens_keeps_what_was_written_of_its_arguments(client):
    """Before: a "required" call whose output max_tokens cut after the function's name, before its arguments
    began, answered arguments "{}", which reads as a whole call without arguments. Now a cut call's arguments
    are what the model wrote of them (empty if nothing), streamed or not, with finish_reason "length"; the
    same request with room enough gives the whole call, of which the cut one's arguments are the beginning."""
    request = dict(tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=False, **COMPACT)
    whole = chat(client, **request, max_tokens=200).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls", whole
    arguments = whole["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments).keys() == {"city"}
    cuts = []
    for max_tokens in range(1, 60):  # from the first budget that names the call to one that cuts its arguments
        choice = chat(client, **request, max_tokens=max_tokens).json()["choices"][0]
        if not choice["message"].get("tool_calls"):
            continue
        assert choice["finish_reason"] == "length", choice
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        cut = call["function"]["arguments"]
        assert arguments.startswith(cut) and cut != arguments, (max_tokens, cut, arguments)
        streamed, finish = chat_stream_calls(client, **request, max_tokens=max_tokens)
        assert finish == "length" and streamed == {0: {"name": "get_weather", "arguments": cut}}, streamed
        cuts.append(cut)
        if cut:
            break
    assert cuts[0] == "" and cuts[-1], cuts  # cut before the arguments began, and inside them


def test_cut_calls_stream_the_arguments_the_whole_answer_gives(client):
    """Before: a call cut by max_tokens where its constraint let the model write whitespace streamed that trailing
    whitespace in its argument fragments, which the whole answer strips: the fragments added up to '{   \r'
    against '{', and the Responses API's final object, built from what it streamed, said the same. Now a stream
    holds back whitespace at the end of arguments still being written: streamed and whole answers agree at every
    budget, chat and Responses, a named tool and "required"."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    trailing = 0  # budgets at which the named call's raw output (its arguments) ended in whitespace
    for tool_choice in (named, "required"):
        for max_tokens in range(1, 13):
            request = dict(tools=[CHAT_TOOL], tool_choice=tool_choice, max_tokens=max_tokens)
            whole = chat(client, **request).json()["choices"][0]
            calls = {i: {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for i, c in enumerate(whole["message"].get("tool_calls") or [])}
            streamed, finish = chat_stream_calls(client, **request)
            assert (streamed, finish) == (calls, whole["finish_reason"]), (tool_choice, max_tokens)
            if tool_choice is named:  # the same tokens as text: a named call's constraint is its parameters' schema
                raw = chat(client, max_tokens=max_tokens, response_format={
                    "type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}).json()
                raw = raw["choices"][0]["message"]["content"]
                assert raw.strip() == calls[0]["arguments"], (max_tokens, raw, calls)
                trailing += raw != raw.rstrip()
    for max_output_tokens in range(1, 13):
        request = dict(input="Weather in Oslo?", tools=[RESPONSES_TOOL], max_output_tokens=max_output_tokens,
                       tool_choice={"type": "function", "name": "get_weather"})
        whole = [(item["type"], item.get("arguments")) for item in responses(client, **request).json()["output"]]
        streamed = events(client, **request)
        final = [(item["type"], item.get("arguments")) for item in streamed[-1]["response"]["output"]]
        done = [e["arguments"] for e in streamed if e["type"] == "response.function_call_arguments.done"]
        assert final == whole and done == [a for kind, a in whole if kind == "function_call"], max_output_tokens
    assert trailing, "no budget cut a call in whitespace: the case this test is for did not occur"

def test_required_calls_cut_before_a_name_answer_no_text(client):
    """Before: under tool_choice "required", an output cut before its first call was named answered the
    constraint's beginning as the assistant's text (content '[{"nam'). Now such a message has no content and no
    tool_calls, finish_reason "length", streamed or not; the Responses API gives no message item."""
    seen = 0
    for max_tokens in range(1, 8):
        request = dict(tools=[CHAT_TOOL], tool_choice="required", max_tokens=max_tokens)
        choice = chat(client, **request).json()["choices"][0]
        if choice["message"].get("tool_calls"):
            continue
        seen += 1
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None, choice
        with client.stream("POST", "/v1/chat/completions", json={"model": DEMO, "messages": MESSAGES,
                                                                 "temperature": 0, "stream": True, **request}) as answer:
            text = "".join(c["delta"].get("content") or "" for line in answer.iter_lines()
                           if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
        assert text == "", (max_tokens, text)
        output = responses(client, input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required",
                           max_output_tokens=max_tokens).json()["output"]
        assert [item["type"] for item in output] in ([], ["function_call"]), output
    assert seen, "every budget named a call: the case this test is for did not occur"

# --- Responses fields that would otherwise be ignored --------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"conversation": "conv_123"}, "conversation"),
    ({"conversation": {"id": "conv_123"}}, "conversation"),
    ({"prompt": {"id": "pmpt_123", "version": "2"}}, "prompt"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"include": "message.output_text.logprobs"}, "include"),
])
def test_responses_refuses_what_it_would_ignore(client, fields, param):
    refused(responses(client, input="Hello", **fields), param, "not supported" if param != "include" or
            isinstance(fields["include"], list) else "must be a list")


def test_responses_takes_the_no_op_values_of_those_fields(client):
    """What asks for nothing still passes: the Agents SDK's empty include, an encrypted-reasoning include (there is
    no reasoning to include), top_logprobs 0, a reasoning effort for a model that writes no reasoning."""
    for fields in ({"include": []}, {"include": ["reasoning.encrypted_content"]}, {"top_logprobs": 0},
                   {"reasoning": {"effort": "low"}}, {"conversation": None, "prompt": None}):
        answer = responses(client, input="Hello", max_output_tokens=1, **fields)
        assert answer.status_code == 200, (fields, answer.text)


# --- tool_choice and tools of the wrong shape ----------------------------------------------------------------

def test_tool_choice_of_another_shape_names_the_accepted_forms(client):
    chat_named = '{"type": "function", "function": {"name": ...}}'
    flat_named = '{"type": "function", "name": ...}'
    # the Responses API's flat form sent to chat completions, and the other way round
    message = refused(chat(client, tools=[CHAT_TOOL], tool_choice={"type": "function", "name": "get_weather"}),
                      "tool_choice", chat_named, "Responses API")
    assert "Input should be" not in message
    refused(responses(client, input="Hi", tools=[RESPONSES_TOOL],
                      tool_choice={"type": "function", "function": {"name": "get_weather"}}),
            "tool_choice", flat_named, "chat completions form")
    refused(chat(client, tools=[CHAT_TOOL], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}),
            "tool_choice", '"allowed_tools" is not supported', chat_named)
    refused(chat(client, tools=[CHAT_TOOL], tool_choice="always"), "tool_choice", '"required" or', 'got "always"')
    refused(responses(client, input="Hi", tools=[RESPONSES_TOOL], tool_choice={"type": "function"}),
            "tool_choice", f"name the function as {flat_named}")


def test_tool_parameters_must_be_an_object_schema(client):
    """A call's arguments are a JSON object: a tool whose parameters declare another type is refused (named, it
    was constrained to that type and answered arguments that are not an object, nor even JSON)."""
    string_tool = {"type": "function", "function": {"name": "echo", "parameters": {"type": "string"}}}
    refused(chat(client, tools=[string_tool], tool_choice={"type": "function", "function": {"name": "echo"}}),
            "tools", 'tools.0.function.parameters: a function\'s parameters must be a JSON schema of type "object"',
            'got type "string"')
    refused(chat(client, tools=[CHAT_TOOL, {"type": "function", "function": {
        "name": "f", "parameters": {"type": ["object", "null"], "properties": {}}}}]), "tools",
        "tools.1.function.parameters", 'got type ["object", "null"]')
    refused(responses(client, input="Hi", tools=[{"type": "function", "name": "echo", "parameters": {"type": "array"}}],
                      tool_choice="required"), "tools", "tools.0.parameters: a function's parameters", '"array"')
    # an object schema without "type" (a root $ref, as pydantic writes for recursive models) is still taken
    ref_tool = {"type": "function", "function": {"name": "r", "parameters": {
        "$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x"], "additionalProperties": False}}, "$ref": "#/$defs/A"}}}
    answer = chat(client, tools=[ref_tool], tool_choice={"type": "function", "function": {"name": "r"}},
                  max_tokens=12, **COMPACT)
    assert answer.status_code == 200, answer.text
    arguments = json.loads(answer.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    assert isinstance(arguments, dict) and set(arguments) == {"x"}


def test_a_tool_schema_that_fails_is_named_in_the_clients_terms(client):
    """Under "required" the calls' schema wraps every tool's parameters; a form the backend refuses is said of the
    tool and the place in its own parameters, not of the wrapper (items.anyOf.1.properties.parameters...)."""
    bad = {"type": "object", "properties": {"a": {"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 1}]}}}
    tools = [CHAT_TOOL, {"type": "function", "function": {"name": "bad", "parameters": bad}}]
    for choice in ("required", {"type": "function", "function": {"name": "bad"}}):
        message = refused(chat(client, tools=tools, tool_choice=choice), "tools.1.function.parameters",
                          "tools.1.function.parameters could not be compiled", "(at properties.a.allOf)")
        assert "items" not in message and "anyOf" not in message, message
    flat = [RESPONSES_TOOL, {"type": "function", "name": "bad", "parameters": bad}]
    message = refused(responses(client, input="Hi", tools=flat, tool_choice="required"), "tools.1.parameters",
                      "tools.1.parameters could not be compiled", "(at properties.a.allOf)")
    assert "function" not in message, message
    # an invalid type, under a named choice
    typo = [{"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]
    refused(chat(client, tools=typo, tool_choice={"type": "function", "function": {"name": "t"}}),
            "tools.0.function.parameters", "strin")


def test_tool_schemas_beyond_the_constraint_limit_are_400s(client):
    """Parameters longer than a constraint may be (1 MiB) under "required" or a named function: a 400 naming the
    tools, not a 500 from the constraint's own check."""
    from kvshard.sampling_params import MAX_CONSTRAINT_CHARS

    big = {"type": "object", "properties": {f"p{i:06d}": {"type": "integer", "description": "x" * 40}
                                            for i in range(MAX_CONSTRAINT_CHARS // 60)}}
    assert len(json.dumps(big)) > MAX_CONSTRAINT_CHARS
    tools = [CHAT_TOOL, {"type": "function", "function": {"name": "big", "parameters": big}}]
    refused(chat(client, tools=tools, tool_choice="required"), "tools", f"longer than {MAX_CONSTRAINT_CHARS}")
    refused(chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "big"}}),
            "tools.1.function.parameters", f"longer than {MAX_CONSTRAINT_CHARS}")
    refused(responses(client, input="Hi", tools=[{"type": "function", "name": "big", "parameters": big}],
                      tool_choice={"type": "function", "name": "big"}), "tools.0.parameters",
            f"tools.0.parameters is longer than {MAX_CONSTRAINT_CHARS}")
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("route, fields, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": WEATHER}}},
     "response_format.json_schema.name"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "",
                                                                                          "schema": WEATHER}}},
     "response_format.json_schema.name"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "schema": WEATHER}}}, "text.format.name"),
])
def test_a_json_schema_format_needs_its_name(client, route, fields, param):
    """Before: a json_schema format without `name` was taken, and the Responses API echoed it back without one,
    which the SDK's own type rejects; OpenAI and vLLM require it."""
    body = {"model": DEMO, **fields}
    body |= ({"messages": MESSAGES, "max_tokens": 4} if route.endswith("completions") else
             {"input": "Weather in Oslo?", "max_output_tokens": 4})
    refused(client.post(route, json=body), param, "needs a name")
    named = dict(fields)
    if route.endswith("completions"):
        named["response_format"] = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    else:
        named["text"] = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    assert client.post(route, json={**body, **named}).status_code == 200
