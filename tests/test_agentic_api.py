"""Agents' API: tool calling, structured-output fields, the Responses API, /tokenize and /detokenize.

Three layers, cheapest first: the tool-call parsers of the four formats on whole texts and on streams cut at
every character; the request fields checked by the app in this process, whose engine loop never runs (a bad
request that reached the engine would hang, so each 400 also shows it stopped at the door); and two shared
servers at tp=2, dcp=2, `kvshard serve smollm2-135m-instruct` (hermes parser) and the random `kvshard-demo-mla`
(deepseek_v3 parser), spoken to by the official `openai` client. The requests whose answers the tests only read
are sent to both at once, so that they share decode steps.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvshard.entrypoints.openai.protocol import APIError, ChatCompletionRequest, _parse
from kvshard.entrypoints.openai.serving_chat import chat_message, shipped_template, tool_constraint
from kvshard.entrypoints.openai.tool_parsers import (NamedToolParser, RequiredToolParser, ToolCallStream,
                                                     get_tool_parser)
from kvshard.sampling_params import MAX_CONSTRAINT_CHARS

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ARGS = '{"city": "Pa\\"ris", "days": [1, {"a": "}"}]}'  # a quote, nesting and a brace inside a string

FORMATS = {
    "hermes": (f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>', "Let me look."),
    "llama3_json": (f'<|python_tag|>{{"name": "get_weather", "parameters": {ARGS}}}; '
                    '{"name": "get_time", "parameters": {"city": "Rome"}}', None),
    "deepseek_v3": ("Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    f"```json\n{ARGS}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
                    '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me look."),
    "kimi_k2": ("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                f"<|tool_call_argument_begin|>{ARGS}<|tool_call_end|><|tool_call_begin|>functions.get_time:1"
                '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>',
                "Let me look."),
}
PLAIN = "The capital of France is <b>Paris</b>; 1 < 2 and {braces} stay text."


def streamed(parser, text: str, max_calls: int | None = None) -> tuple[str, list[dict], list[list[dict]]]:
    """Feed `text` cut after every character; the content, the calls reassembled from the deltas, the deltas."""
    stream = ToolCallStream(parser, max_calls)
    content, calls, all_deltas = "", [], []
    for end, final in [(end, False) for end in range(1, len(text) + 1)] + [(len(text), True)]:
        piece, deltas = stream.feed(text[:end], final)
        content += piece
        all_deltas.append(deltas)
        for delta in deltas:
            if "id" in delta:  # a call's first delta, the only one with id, type and name
                assert delta["index"] == len(calls) and delta["type"] == "function"
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls, all_deltas


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parser_reads_calls_whole_and_streamed(name):
    parser = get_tool_parser(name)
    text, content = FORMATS[name]
    message, finish = chat_message(text, "stop", parser, "auto", None)
    assert finish == "tool_calls"
    assert message["content"] == content
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", json.loads(ARGS)), ("get_time", {"city": "Rome"})]
    if name == "kimi_k2":  # the format's own ids
        assert [c["id"] for c in message["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    # streamed, cut after every character: the same content and the same arguments, fragment by fragment
    streamed_content, streamed_calls, deltas = streamed(parser, text)
    assert streamed_content == (content or "")
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert sum(len(d) for d in deltas) > 4  # the arguments came in fragments, not at the end in one piece
    # parallel_tool_calls false: the first call only
    assert len(chat_message(text, "stop", parser, "auto", 1)[0]["tool_calls"]) == 1
    assert len(streamed(parser, text, max_calls=1)[1]) == 1


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parser_leaves_text_without_calls_alone(name):
    parser = get_tool_parser(name)
    assert chat_message(PLAIN, "stop", parser, "auto", None) == ({"role": "assistant", "content": PLAIN}, "stop")
    assert streamed(parser, PLAIN)[:2] == (PLAIN, [])
    # a call cut off by max_tokens keeps finish_reason "length"
    text = FORMATS[name][0]
    assert chat_message(text[: len(text) // 2], "length", parser, "auto", None)[1] == "length"


# calls whose JSON the model left open before it ended them, then more text: (the text, the calls' arguments)
LEFT_OPEN = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>\nDone.\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}\n</tool_call>',
               ['{"city": "Paris"', '{"city": "Rome"}']),
    "deepseek_v3": ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"city": "Paris"\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                    'get_time\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    ['{"city": "Paris"', '{"city": "Rome"}']),
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                '{"city": "Paris<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>'
                '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|>',
                ['{"city": "Paris', '{"city": "Rome"}']),
}


@pytest.mark.parametrize("name", sorted(LEFT_OPEN))
def test_a_call_left_open_ends_at_its_end_marker(name):
    """Before: a call whose arguments' JSON the model did not close before ending the call (hermes'
    `</tool_call>`, DeepSeek's fence and end token, Kimi's end token) took the marker and everything after it,
    later calls too, as its arguments. Now the call ends at its marker, with the arguments as written up to it,
    and the calls after it are read; streamed, the fragments add up to the same."""
    parser = get_tool_parser(name)
    text, arguments = LEFT_OPEN[name]
    message, finish = chat_message(text, "stop", parser, "auto", None)
    assert finish == "tool_calls"
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert got == list(zip(["get_weather", "get_time"], arguments))
    _, streamed_calls, _ = streamed(parser, text)
    assert [(c["name"], c["arguments"]) for c in streamed_calls] == got


def test_a_hermes_call_whose_object_is_left_open_ends_at_its_tag():
    parser = get_tool_parser("hermes")
    text = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}\n</tool_call>'
    message, finish = chat_message(text, "stop", parser, "auto", None)
    assert finish == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert [c["arguments"] for c in streamed(parser, text)[1]] == ['{"city": "Rome"}']
    # cut in that tag: the call as written, not dropped (the tag's first characters are not "not JSON")
    message, finish = chat_message(text[:-4], "length", parser, "auto", None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_time", '{"city": "Rome"}')] and finish == "length"
    # a call cut by max_tokens in its end tag: the tag's first characters are no part of the arguments
    for cut in ('{"city": "Rome"\n</tool', '{"city": "Rome"\n<'):
        text = '<tool_call>\n{"name": "get_time", "arguments": ' + cut
        message, finish = chat_message(text, "length", parser, "auto", None)
        assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"', cut
        assert [c["arguments"] for c in streamed(parser, text)[1]] == ['{"city": "Rome"'], cut


def test_streamed_arguments_never_carry_whitespace_the_whole_answer_strips():
    """Fragments once sent cannot be taken back: arguments still being written are sent without whitespace at
    their end, so that a call cut there adds up to the whole answer's stripped arguments."""
    for parser, text in ((NamedToolParser("get_weather"), '{ \r\n  "city"  :  "Os lo" \t'),
                         (get_tool_parser("hermes"), '<tool_call>\n{"name": "get_weather", "arguments": {  "city" \n')):
        message, _ = chat_message(text, "length", parser, "named" if parser.name == "named" else "auto", None)
        _, calls, _ = streamed(parser, text)
        assert [c["arguments"] for c in calls] == [c["function"]["arguments"] for c in message["tool_calls"]], text


def test_required_and_named_outputs():
    array = '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}, {"name": "get_time", ' \
            '"parameters": {"city": "Rome"}}]'
    message, finish = chat_message(array, "stop", RequiredToolParser(), "required", None)
    assert finish == "tool_calls" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Oslo", "days": 2},
                                                                                      {"city": "Rome"}]
    assert [c["name"] for c in streamed(RequiredToolParser(), array)[1]] == ["get_weather", "get_time"]
    message, finish = chat_message('{"city": "Oslo", "days": 2}', "stop", NamedToolParser("get_weather"), "named",
                                   None)
    assert finish == "stop"  # as OpenAI answers a named function
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}


def test_tool_constraints_are_the_tools_schemas():
    from kvshard.entrypoints.openai.api_server import check_compiles

    request = _parse(ChatCompletionRequest, json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                        "tools": TOOLS}).encode())
    named = tool_constraint(request.tools, "named", "get_time", True)
    assert named.json == TOOLS[1]["function"]["parameters"]
    required = tool_constraint(request.tools, "required", None, True).json
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert required["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER
    assert tool_constraint(request.tools, "required", None, False).json["maxItems"] == 1
    assert tool_constraint(request.tools, "auto", None, True) is None
    compact = _parse(ChatCompletionRequest, json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
        "structured_outputs": {"disable_any_whitespace": True}}).encode())
    assert compact.with_whitespace_option(named).disable_any_whitespace and not named.disable_any_whitespace
    for mode, name in (("named", "get_weather"), ("required", None)):
        check_compiles(tool_constraint(request.tools, mode, name, False))  # xgrammar takes them


def test_field_mapping_to_structured_outputs():
    def constraint(**fields):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
        return _parse(ChatCompletionRequest, json.dumps(body).encode()).constraint()

    got, field = constraint(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                                     "strict": True}})
    assert (got.json, field) == (WEATHER, "response_format.json_schema.schema")
    assert constraint(response_format={"type": "json_object"})[0].json_object is True
    assert constraint(response_format={"type": "text"}) == (None, None)
    assert constraint(structured_outputs={"regex": "[a-z]+"})[0].regex == "[a-z]+"
    assert constraint(structured_outputs={"choice": ["yes", "no"]})[0].choice == ["yes", "no"]
    assert constraint(guided_json=WEATHER) [0].json == WEATHER
    assert (constraint(guided_regex="a+")[0].regex, constraint(guided_regex="a+")[1]) == ("a+", "guided_regex")
    assert constraint(guided_choice=["a", "b"])[0].choice == ["a", "b"]
    assert constraint(guided_grammar='root ::= "a"')[0].grammar == 'root ::= "a"'
    # disable_any_whitespace alone: an option of the constraint another field gives, as vLLM takes it
    compact = constraint(response_format={"type": "json_object"}, structured_outputs={"disable_any_whitespace": True})
    assert compact[0].json_object and compact[0].disable_any_whitespace and compact[1] == "response_format"
    assert not constraint(response_format={"type": "json_object"})[0].disable_any_whitespace
    assert constraint(structured_outputs={"disable_any_whitespace": True}) == (None, None)
    for fields, param in [({"guided_json": {}}, "guided_json"), ({"guided_choice": []}, "guided_choice"),
                          ({"structured_outputs": {"json": WEATHER, "regex": "a"}}, "structured_outputs"),
                          ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
                          ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}},
                           "response_format.json_schema.schema"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                           "response_format.json_schema.schema"),
                          ({"response_format": {"type": "yaml"}}, "response_format.type"),
                          ({"structured_outputs": {"disable_any_whitespace": "yes"}},
                           "structured_outputs.disable_any_whitespace")]:
        with pytest.raises(APIError) as error:
            constraint(**fields)
        assert (error.value.status, error.value.param) == (400, param), (fields, error.value.message)


# --- the app in this process: what is refused at the door ----------------------------------------------------

DEMO = "kvshard-demo-gqa"


@pytest.fixture(scope="module")
def app_server():
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.entrypoints.openai_server import OpenAIServer

    engine = LLMEngine(EngineArgs(model=DEMO, max_model_len=256, kv_cache_memory="16MiB").create_engine_config())
    yield OpenAIServer(engine, [DEMO], enable_auto_tool_choice=True, tool_call_parser="hermes")
    engine.shutdown()


def call(server, requests, timeout: float = 120):
    """`requests(client)` against the app in a thread of its own: the engine loop never runs here, so a request
    that reached the engine hangs and fails the test instead of answering."""
    result = {}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://app",
                                     timeout=60) as client:
            return await requests(client)

    def thread() -> None:
        try:
            result["value"] = asyncio.run(run())
        except BaseException as error:
            result["error"] = error

    worker = threading.Thread(target=thread, daemon=True)
    worker.start()
    worker.join(timeout)
    assert not worker.is_alive(), "the request reached the engine"
    if "error" in result:
        raise result["error"]
    return result["value"]


MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]
CHAT_REFUSALS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format.json_schema.schema"),  # an invalid schema
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
     "response_format.json_schema.schema"),  # an empty schema
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # tool_choice without tools
    ({"tools": []}, "tools"),
    ({"structured_outputs": {"regex": "a+("}}, "structured_outputs"),  # a regex that does not compile
    ({"guided_regex": "(?P<x>a)"}, "guided_regex"),  # one the grammar backend's regex dialect does not take
    ({"guided_grammar": "root ::= " + " | ".join(['"a"'] * (MAX_CONSTRAINT_CHARS // 6))}, "guided_grammar"),
    ({"guided_grammar": 'root ::= "a" | b'}, "guided_grammar"),  # an undefined rule
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),  # a tool type other than function
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),  # only an assistant turn may come without content
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),  # no schema in either form
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, "response_format"),
]


def test_bad_chat_requests_are_400s_naming_the_field(app_server):
    async def requests(client):
        answers = []
        for fields, _ in CHAT_REFUSALS:
            body = {"model": DEMO, "messages": MESSAGES, "max_tokens": 4, **fields}
            answers.append(await client.post("/v1/chat/completions", json=body))
        return answers

    for (fields, param), answer in zip(CHAT_REFUSALS, call(app_server, requests)):
        assert answer.status_code == 400, (fields, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (fields, error)


def test_auto_tool_choice_needs_a_parser(app_server):
    from kvshard.entrypoints.openai_server import OpenAIServer

    plain = OpenAIServer.__new__(OpenAIServer)
    plain.__dict__.update(app_server.__dict__)
    plain.tool_parser = None
    plain.app = plain._build_app()

    async def requests(client):
        return await client.post("/v1/chat/completions", json={"model": DEMO, "messages": MESSAGES, "tools": TOOLS})

    answer = call(plain, requests)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in answer.json()["error"]["message"]


RESPONSES_REFUSALS = [
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format.schema"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),  # the chat request's max_completion_tokens
    ({"input": "hi " * 2000}, "input"),  # too long: the chat request's messages
    ({"input": ["hi"]}, "input"),  # a bare string among the items
    ({"input": "hi", "truncation": "auto"}, "truncation"),  # no item is ever dropped: not accepted and ignored
]


def test_refusals_say_what_is_wrong_in_the_clients_own_terms(app_server):
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
              "content parts of type 'input_audio' are not supported"),
             ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
                                                                        "function": {"name": "get_weather"}},
                                       "response_format": {"type": "json_object"}},
              'tool_choice naming function "get_weather"'),
             ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
              "response_format.json_schema = {name, schema, strict}"),
             ("/v1/responses", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens must be"),
             ("/v1/responses", {"input": "hi " * 2000}, "input: "),
             ("/v1/responses", {"input": [{"role": "user", "content": "hi"}, 7]}, "item 1 is a int")]

    async def requests(client):
        answers = []
        for route, fields, _ in cases:
            body = {"model": DEMO, **({"messages": MESSAGES} if "chat" in route else {}), "max_tokens": 4, **fields}
            answers.append(await client.post(route, json=body))
        return answers

    for (route, fields, said), answer in zip(cases, call(app_server, requests)):
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400 and said in message, (fields, message)
        assert "Input should be a valid string" not in message and "NamedToolChoice(" not in message, message
        if route == "/v1/responses":  # the chat request it became is not the client's
            assert "messages" not in message and "max_tokens" not in message.split(".")[0], message


def test_bad_responses_requests_are_400s_naming_the_field(app_server):
    async def requests(client):
        return [await client.post("/v1/responses", json={"model": DEMO, **fields}) for fields, _ in RESPONSES_REFUSALS]

    for (fields, param), answer in zip(RESPONSES_REFUSALS, call(app_server, requests)):
        assert answer.status_code == 400, (fields, answer.text)
        assert answer.json()["error"]["param"] == param, (fields, answer.json())


def test_tokenize_and_detokenize(app_server):
    tokenizer = app_server.tokenizer

    async def requests(client):
        return (await client.post("/tokenize", json={"model": DEMO, "prompt": "Hello world"}),
                await client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                     "return_token_strs": True}),
                await client.post("/tokenize", json={"messages": MESSAGES}),
                await client.post("/detokenize", json={"tokens": tokenizer.encode("Hello world",
                                                                                  add_special_tokens=False)}),
                await client.post("/detokenize", json={"tokens": [10**9]}),
                await client.post("/tokenize", json={"model": "other", "prompt": "x"}),
                # the messages chat would refuse: a tool answer that names no call
                await client.post("/tokenize", json={"messages": [{"role": "tool", "content": "sunny"}]}))

    tokens, plain, chat, text, bad, other, orphan = call(app_server, requests)
    assert tokens.json()["tokens"] == tokenizer.encode("Hello world")
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) and tokens.json()["max_model_len"] == 256
    assert plain.json()["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert plain.json()["token_strs"] == tokenizer.convert_ids_to_tokens(plain.json()["tokens"])
    want = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    assert text.json() == {"prompt": "Hello world"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert other.status_code == 404
    assert orphan.status_code == 400 and orphan.json()["error"]["param"] == "messages.0.tool_call_id"


def test_shipped_template_renders_as_smollm2s_own_without_tools(app_server):
    """Without tools the shipped template is SmolLM2's own (the same prompt, so the same answers); with them it
    lists the tools and renders calls and their results in the hermes format."""
    own = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
           "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    ours = shipped_template(own)
    assert ours is not None and shipped_template("{{ tools }}<|im_start|>SmolLM") is None
    tokenizer = app_server.tokenizer  # any Hugging Face tokenizer renders a given template the same way
    for conversation in ([{"role": "user", "content": "Hi"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        for prompt in (True, False):
            assert tokenizer.apply_chat_template(conversation, chat_template=ours, tokenize=False,
                                                 add_generation_prompt=prompt) == \
                tokenizer.apply_chat_template(conversation, chat_template=own, tokenize=False,
                                              add_generation_prompt=prompt)
    turn = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = tokenizer.apply_chat_template(turn, tools=[t for t in TOOLS], chat_template=ours, tokenize=False,
                                         add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text


# --- two real servers at tp=2, dcp=2, the official openai client -------------------------------------------

SMOL, MLA = "smollm2-135m-instruct", "kvshard-demo-mla"
LAYOUT = ["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"]
SERVED = {
    # SmolLM2 has 9 query and 3 KV heads: tp=2, dcp=2 runs its replicated attention layout; hermes, its format
    SMOL: [SMOL, *LAYOUT, "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--enable-auto-tool-choice",
           "--tool-call-parser", "hermes"],
    # DeepSeek-V3 in miniature (latent attention: the cache split along the sequence only), random weights; its
    # streams gather 3 tokens an event (--stream-interval), so every streamed tool call here is parsed from deltas
    # of several tokens
    MLA: [MLA, *LAYOUT, "--max-model-len", "1024", "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice",
          "--tool-call-parser", "deepseek_v3", "--stream-interval", "3"],
}
# A random model's greedy pick among the tokens a JSON constraint allows is mostly whitespace, up to the bound of
# each run (and SmolLM2-135M writes its tool calls with runs of blanks in every gap): these are asked for compact
# JSON (vLLM's option), so that the outputs end well within max_tokens. SmolLM2's parse() answers keep the
# default whitespace.
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
EXTRA = {SMOL: None, MLA: COMPACT}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
TWO_CALLS_QUESTION = [{"role": "user", "content": "What is the weather in Paris for 2 days, and the time in Rome?"}]


# Tools and output schemas as Pydantic models, bounded (maxLength, maxItems, ranges) so that a 135M or random
# model cannot run on to max_tokens; the SDK writes their strict JSON schemas, as its helpers ask.
class GetWeather(BaseModel):
    """The weather forecast in a city"""
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=16)
    days: int = Field(ge=1, le=7)


class GetTime(BaseModel):
    """The local time in a city"""
    model_config = ConfigDict(extra="forbid", strict=True)
    city: str = Field(max_length=16)


TOOL_MODELS = {"get_weather": GetWeather, "get_time": GetTime}
SDK_TOOLS = [openai.pydantic_function_tool(model, name=name) for name, model in TOOL_MODELS.items()]
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": SDK_TOOLS[0]["function"]["parameters"],
                  "strict": True}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Capital(Strict):  # flat strings
    country: str = Field(max_length=16)
    capital: str = Field(max_length=16)


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Day(Strict):
    name: str = Field(max_length=10)
    high: int = Field(ge=-60, le=60)


class Forecast(Strict):  # an enum and an array of objects
    city: str = Field(max_length=16)
    unit: Unit
    days: list[Day] = Field(min_length=1, max_length=2)


class Person(Strict):  # an integer range and an optional field
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    email: str | None = Field(default=None, max_length=24)


class Item(Strict):
    sku: str = Field(max_length=8)
    quantity: int = Field(ge=1, le=9)


class Order(Strict):  # a literal enum and an array of objects
    status: Literal["pending", "shipped", "delivered"]
    items: list[Item] = Field(min_length=1, max_length=2)


class Review(Strict):  # a boolean
    rating: int = Field(ge=1, le=5)
    recommended: bool
    summary: str = Field(max_length=24)


class Address(Strict):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Company(Strict):  # a nested object
    name: str = Field(max_length=16)
    headquarters: Address


class Room(Strict):
    name: str = Field(max_length=8)
    floor: int = Field(ge=0, le=20)


class Meeting(Strict):  # an optional nested object and an array of strings
    title: str = Field(max_length=20)
    room: Room | None
    attendees: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


class Colors(Strict):  # an array of enum values and an optional enum
    colors: list[Literal["red", "white", "blue", "green"]] = Field(min_length=1, max_length=3)
    favourite: Literal["red", "white", "blue", "green"] | None


SCHEMAS = [(Capital, "What is the capital of France?"), (Forecast, "Give a one-day weather forecast for Paris."),
           (Person, "Describe Ann, who is 31 years old."), (Order, "An order of 2 apples (sku APL) has shipped."),
           (Review, "Review the film Up in one short line."), (Company, "Where is the company Airbus based?"),
           (Meeting, "A team meeting in room 4B on floor 2 with Ann and Bob."),
           (Colors, "Which of these colors are on the French flag?")]


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory):
    """The session's SmolLM2 server (conftest's `smollm2_server`, started with `SERVED[SMOL]`) and one MLA server,
    which starts while SmolLM2 is fetched, converted and started (where this module is the first to ask for it)."""
    from conftest import SMOLLM2_SERVE_ARGS
    from server_harness import Server

    assert SMOLLM2_SERVE_ARGS == SERVED[SMOL], "the shared SmolLM2 server must be the one these tests describe"
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(Server, SERVED[MLA], tmp_path_factory.mktemp("servers") / f"{MLA}.log",
                               startup_timeout=600)
        try:
            smollm2_server = request.getfixturevalue("smollm2_server")
        except BaseException:  # a failed start, or a skip where SmolLM2 cannot be fetched
            if starting.exception() is None:
                starting.result().stop()
            raise
        mla = starting.result()
    yield {SMOL: smollm2_server, MLA: mla}
    assert mla.stop() == 0, mla.log


@pytest.fixture(scope="module")
def smol(servers):
    return servers[SMOL]


async def _answers(server, model: str) -> dict[str, Any]:
    """Every request of the tests that only read their answers, sent at once (they share decode steps)."""
    client = server.async_client()
    greedy = dict(model=model, temperature=0)
    compact = dict(greedy, extra_body=COMPACT)
    required = dict(tools=SDK_TOOLS, tool_choice="required", max_tokens=80, **compact)
    named = dict(messages=WEATHER_QUESTION, tools=SDK_TOOLS, max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}, **compact)

    async def reassembled(**request):
        async with client.chat.completions.stream(**request) as stream:
            return await stream.get_final_completion()

    first = asyncio.ensure_future(client.chat.completions.create(messages=WEATHER_QUESTION, **required))

    async def second_turn():
        call = (await first).choices[0].message.tool_calls[0]
        turn = WEATHER_QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 C"}]
        return turn, await client.chat.completions.create(messages=turn, tools=SDK_TOOLS, max_tokens=12, **compact)

    responses = dict(model=model, input="What is the weather in Paris for 2 days?", temperature=0,
                     tools=[RESPONSES_TOOL], tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                     extra_body=COMPACT)

    async def events():
        return [event async for event in await client.responses.create(stream=True, **responses)]

    requests = {
        **{f"parse {schema.__name__}": client.chat.completions.parse(
            messages=[{"role": "user", "content": question}], response_format=schema, max_tokens=200,
            extra_body=EXTRA[model], **greedy)
           for schema, question in SCHEMAS},
        "required": first,
        "required streamed": reassembled(messages=WEATHER_QUESTION, **required),
        "one call": client.chat.completions.create(messages=TWO_CALLS_QUESTION, parallel_tool_calls=False, **required),
        "one call streamed": reassembled(messages=TWO_CALLS_QUESTION, parallel_tool_calls=False, **required),
        "named": client.chat.completions.create(**named),
        "named streamed": reassembled(**named),
        "second turn": second_turn(),
        "responses": client.responses.create(**responses),
        "responses streamed": events(),
    }
    try:
        return dict(zip(requests, await asyncio.gather(*requests.values(), return_exceptions=True)))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def answers(servers):
    async def both():
        return await asyncio.gather(*(_answers(server, model) for model, server in servers.items()))

    return dict(zip(servers, asyncio.run(both())))


def answer(answers, model: str, name: str):
    value = answers[model][name]
    if isinstance(value, BaseException):
        raise value
    return value


def tokenized(server, model: str = SMOL, **body) -> list[int]:
    return server.http.post("/tokenize", json={"model": model, **body}).json()["tokens"]


def valid_call(call) -> BaseModel:
    """A tool call's arguments, validated (strictly) against its tool's schema."""
    assert call.type == "function" and call.id and call.function.name in TOOL_MODELS, call
    return TOOL_MODELS[call.function.name].model_validate_json(call.function.arguments)


BOTH = pytest.mark.parametrize("model", [SMOL, MLA], ids=["smollm2", "mla"])


@BOTH
def test_parse_returns_a_parsed_object_for_eight_schemas(answers, model):
    for schema, _ in SCHEMAS:
        reply = answer(answers, model, f"parse {schema.__name__}")
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "stop", (schema.__name__, message.content)
        assert isinstance(message.parsed, schema), (schema.__name__, message.content)
        assert schema.model_validate_json(message.content) == message.parsed  # strictly, too


@BOTH
def test_required_and_named_tool_calls_validate_streamed_and_not(answers, model):
    for name in ("required", "required streamed"):
        choice = answer(answers, model, name).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (name, choice)
        for call in choice.message.tool_calls:
            parsed = valid_call(call)
            if name == "required streamed":  # reassembled by the SDK's stream helper, which parses them too
                assert call.function.parsed_arguments == parsed
    for name in ("named", "named streamed"):
        choice = answer(answers, model, name).choices[0]
        assert choice.finish_reason == "stop"  # as OpenAI answers a named function
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(valid_call(call), GetWeather)


@BOTH
def test_parallel_tool_calls_false_gives_one_call(answers, model):
    for name in ("one call", "one call streamed"):
        choice = answer(answers, model, name).choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (name, choice)
        valid_call(choice.message.tool_calls[0])


@BOTH
def test_a_second_turn_answers_from_the_tools_result(servers, answers, model):
    turn, reply = answer(answers, model, "second turn")
    choice = reply.choices[0]
    assert choice.message.content and choice.finish_reason in ("stop", "length"), choice
    tokens = tokenized(servers[model], model, messages=turn, tools=SDK_TOOLS)
    assert reply.usage.prompt_tokens == len(tokens)  # it answered the conversation rendered with the result
    prompt = servers[model].http.post("/detokenize", json={"model": model, "tokens": tokens}).json()["prompt"]
    assert "sunny, 22 C" in prompt


@BOTH
def test_responses_with_a_function_tool(answers, model):
    response = answer(answers, model, "responses")
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    GetWeather.model_validate_json(call.arguments)
    # streamed: the call's item, its argument fragments adding up to the arguments it ends with
    events = answer(answers, model, "responses streamed")
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[0].type == "function_call" and added[0].name == "get_weather"
    fragments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta" and e.item_id == added[0].id)
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert fragments == done[0] and GetWeather.model_validate_json(fragments)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == fragments


def test_second_turn_renders_the_call_and_its_result(smol):
    turn = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"}]
    tokens = tokenized(smol, messages=turn, tools=SDK_TOOLS)
    prompt = smol.http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '<tools>\n{"name": "get_weather"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt


def test_responses_conversation_and_stream(smol):
    client = smol.client()
    first = client.responses.create(model=SMOL, input="What is the capital of France?", temperature=0,
                                    instructions="Answer in one short sentence.", max_output_tokens=16)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    second = client.responses.create(model=SMOL, input="And of Italy?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    # the second's prompt is the first question and answer, then its own (the instructions are not carried over)
    carried = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Italy?"}]
    assert second.usage.input_tokens == len(tokenized(smol, messages=carried))
    # a function call and its output sent back as input items: the model answers from them
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_9", "output": "sunny, 22 C"}]
    answer = client.responses.create(model=SMOL, input=items, temperature=0, max_output_tokens=8,
                                     tools=[RESPONSES_TOOL])
    assert answer.output_text
    # streamed: OpenAI's event sequence, and the same text as the same request not streamed
    events = list(client.responses.create(model=SMOL, input="What is the capital of France?", temperature=0,
                                          instructions="Answer in one short sentence.", max_output_tokens=16,
                                          stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if first.status == "completed" else "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == \
        events[-1].response.output_text == first.output_text


@BOTH
def test_bad_requests_leave_the_server_healthy(servers, model):
    server = servers[model]
    client = server.client()
    question = dict(messages=WEATHER_QUESTION, max_tokens=8, model=model, temperature=0)
    reference = client.chat.completions.create(**question)
    for fields, param in CHAT_REFUSALS[:8] + [({"tools": SDK_TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "get_news"}}}, "tool_choice")]:
        answer = server.http.post("/v1/chat/completions", json={"model": model, "messages": WEATHER_QUESTION, **fields})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert server.http.get("/health").status_code == 200
    again = client.chat.completions.create(**question)
    assert again.choices[0].message.content == reference.choices[0].message.content


def test_response_store_is_a_bounded_lru():
    from kvshard.entrypoints.openai.serving_responses import ResponseStore

    store = ResponseStore(2)
    for name in "abc":
        store.put(name, [{"role": "user", "content": name}])
    assert len(store) == 2 and store.get("a") is None  # the oldest went first
    assert store.get("b") == [{"role": "user", "content": "b"}]  # b is now the most recently used
    store.put("d", [])
    assert store.get("c") is None and store.get("b") is not None and store.get("d") == []
