"""Agents' API: tool calling, structured-output fields, the Responses API, /tokenize and /detokenize.

Three layers, cheapest first: the tool-call parsers of the four formats on whole texts and on streams cut at
every character; the request fields checked by the app in this process, whose engine loop never runs (a bad
request that reached the engine would hang, so each 400 also shows it stopped at the door); and one shared
`kvshard serve smollm2-135m-instruct` (hermes parser) spoken to by the official `openai` client. Tests that need
the grammar engine (constraints enforced while sampling) skip, saying so, on an engine without it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

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
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "tool", "content": "sunny"}]}, "messages.0.tool_call_id"),
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
]


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
                await client.post("/tokenize", json={"model": "other", "prompt": "x"}))

    tokens, plain, chat, text, bad, other = call(app_server, requests)
    assert tokens.json()["tokens"] == tokenizer.encode("Hello world")
    assert tokens.json()["count"] == len(tokens.json()["tokens"]) and tokens.json()["max_model_len"] == 256
    assert plain.json()["tokens"] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert plain.json()["token_strs"] == tokenizer.convert_ids_to_tokens(plain.json()["tokens"])
    want = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    assert text.json() == {"prompt": "Hello world"}
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert other.status_code == 404


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


# --- one real server, the official openai client --------------------------------------------------------------

SMOL = "smollm2-135m-instruct"
# tp=1: the serving layer is the same at every layout (tests/test_smollm2_server.py runs SmolLM2 at tp=2, dcp=2)
SMOL_ARGS = [SMOL, "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
# strict, as the SDK's stream and parse helpers ask of the tools they reassemble
SMOL_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather forecast in a city",
                                                "parameters": WEATHER, "strict": True}},
              {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"], "additionalProperties": False},
                                                "strict": True}}]
GREEDY = dict(model=SMOL, temperature=0)


def grammar_engine() -> bool:
    from kvshard.engine.llm_engine import LLMEngine

    return hasattr(LLMEngine, "check_structured_outputs")


needs_grammar = pytest.mark.skipif(not grammar_engine(), reason="the engine does not enforce output constraints yet "
                                                                 "(no grammar backend in this tree)")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from kvshard.errors import ConfigError
    from kvshard.models.fetch import fetch_gguf_model
    from server_harness import Server

    try:
        fetch_gguf_model(SMOL)
    except ConfigError as error:
        pytest.skip(f"SmolLM2 not fetchable here: {error}")
    running = Server(SMOL_ARGS, tmp_path_factory.mktemp("smol") / "log", startup_timeout=600)
    yield running
    assert running.stop() == 0, running.log


def tokenized(smol, **body) -> list[int]:
    return smol.http.post("/tokenize", json={"model": SMOL, **body}).json()["tokens"]


def test_second_turn_renders_the_call_and_its_result(smol):
    turn = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 22 C"}]
    reply = smol.client().chat.completions.create(messages=turn, tools=SMOL_TOOLS, max_tokens=12, **GREEDY)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
    tokens = tokenized(smol, messages=turn, tools=SMOL_TOOLS)
    assert reply.usage.prompt_tokens == len(tokens)  # the prompt it answered is the one rendered here
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
                                     temperature=0, max_output_tokens=16)
    # the second's prompt is the first question and answer, then its own (the instructions are not carried over)
    carried = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And of Italy?"}]
    assert second.usage.input_tokens == len(tokenized(smol, messages=carried))
    # a function call and its output sent back as input items: the model answers from them
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_9", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}'},
             {"type": "function_call_output", "call_id": "call_9", "output": "sunny, 22 C"}]
    answer = client.responses.create(model=SMOL, input=items, temperature=0, max_output_tokens=12,
                                     tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}])
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


def test_bad_requests_leave_the_server_healthy(smol):
    client = smol.client()
    reference = client.chat.completions.create(messages=WEATHER_QUESTION, max_tokens=8, **GREEDY)
    for fields, param in CHAT_REFUSALS[:7] + [({"tools": SMOL_TOOLS, "tool_choice": {
            "type": "function", "function": {"name": "get_news"}}}, "tool_choice")]:
        answer = smol.http.post("/v1/chat/completions", json={"model": SMOL, "messages": WEATHER_QUESTION, **fields})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert smol.http.get("/health").status_code == 200
    again = client.chat.completions.create(messages=WEATHER_QUESTION, max_tokens=8, **GREEDY)
    assert again.choices[0].message.content == reference.choices[0].message.content


def weather_args(arguments: str) -> dict:
    """Arguments that validate against WEATHER (pydantic, strictly)."""
    from pydantic import BaseModel, ConfigDict

    class Weather(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        city: str
        days: int

    return Weather.model_validate_json(arguments).model_dump()


@needs_grammar
def test_required_and_named_tool_calls_validate(smol):
    client = smol.client()
    required = client.chat.completions.create(messages=WEATHER_QUESTION, tools=SMOL_TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=60, **GREEDY)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    if call.function.name == "get_weather":
        weather_args(call.function.arguments)
    else:
        assert set(json.loads(call.function.arguments)) == {"city"}
    # the same, streamed and reassembled by the SDK's own stream helper
    with client.chat.completions.stream(messages=WEATHER_QUESTION, tools=SMOL_TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=60, **GREEDY) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    named = dict(messages=WEATHER_QUESTION, tools=SMOL_TOOLS, max_tokens=40,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}, **GREEDY)
    whole = client.chat.completions.create(**named)
    assert whole.choices[0].finish_reason == "stop"
    assert whole.choices[0].message.tool_calls[0].function.name == "get_weather"
    args = weather_args(whole.choices[0].message.tool_calls[0].function.arguments)
    # streamed, reassembled by the SDK's own stream helper: the same call
    with client.chat.completions.stream(**named) as stream:
        final = stream.get_final_completion()
    streamed_call = final.choices[0].message.tool_calls[0]
    assert streamed_call.function.name == "get_weather" and weather_args(streamed_call.function.arguments) == args


@needs_grammar
def test_parse_with_pydantic_models_and_responses_with_a_function_tool(smol):
    from enum import Enum

    from pydantic import BaseModel, Field

    # bounded (maxLength, maxItems in the schema), so that a 135M model cannot run on to max_tokens
    class Unit(str, Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Day(BaseModel):
        name: str = Field(max_length=12)
        high: int

    class Forecast(BaseModel):
        city: str = Field(max_length=20)
        unit: Unit
        days: list[Day] = Field(min_length=1, max_length=2)
        note: str | None = Field(max_length=20)

    class Capital(BaseModel):
        country: str = Field(max_length=20)
        capital: str = Field(max_length=20)

    client = smol.client()
    for model, question in ((Capital, "What is the capital of France?"),
                            (Forecast, "Give a two-day weather forecast for Paris.")):
        reply = client.chat.completions.parse(messages=[{"role": "user", "content": question}], response_format=model,
                                              max_tokens=160, **GREEDY)
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
        assert isinstance(reply.choices[0].message.parsed, model)
    response = client.responses.create(model=SMOL, input="What is the weather in Paris for 2 days?", temperature=0,
                                       tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER,
                                               "strict": True}], tool_choice="required", parallel_tool_calls=False,
                                       max_output_tokens=60)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    weather_args(calls[0].arguments)
    # streamed: the call's item, its argument fragments adding up to the same arguments
    events = list(client.responses.create(model=SMOL, input="What is the weather in Paris for 2 days?",
                                          temperature=0, tools=[{"type": "function", "name": "get_weather",
                                                                 "parameters": WEATHER, "strict": True}],
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                          stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[0].type == "function_call" and added[0].name == "get_weather"
    fragments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta" and e.item_id == added[0].id)
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert fragments == done[0] == calls[0].arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == fragments


def test_response_store_is_a_bounded_lru():
    from kvshard.entrypoints.openai.serving_responses import ResponseStore

    store = ResponseStore(2)
    for name in "abc":
        store.put(name, [{"role": "user", "content": name}])
    assert len(store) == 2 and store.get("a") is None  # the oldest went first
    assert store.get("b") == [{"role": "user", "content": "b"}]  # b is now the most recently used
    store.put("d", [])
    assert store.get("c") is None and store.get("b") is not None and store.get("d") == []
