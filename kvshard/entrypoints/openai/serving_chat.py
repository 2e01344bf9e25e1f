"""POST /v1/chat/completions: messages through the chat template, tools and tool calls, structured outputs.

Tools (docs/serving.md, "Tool calling"): with tool_choice "auto" (the default when tools are given) the model
writes freely and the server's tool-call parser (--tool-call-parser) reads its calls from the text; with
"required" or a named function, a structured-output constraint built from the tools' JSON schemas makes the
model write the calls (`tool_constraint`), so that they always parse and their arguments fit the schema.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvshard.entrypoints.openai.protocol import (DEFAULT_CHAT_TEMPLATE, APIError, ChatCompletionRequest, ChatTool,
                                                 _parse, check_continue_final_message)
from kvshard.entrypoints.openai.serving_engine import _cached_tokens, _final_outputs, _unless_disconnected, _usage
from kvshard.entrypoints.openai.tool_parsers import (NamedToolParser, RequiredToolParser, ToolCallStream,
                                                     ToolParser)
from kvshard.entrypoints.openai.tool_parsers.abstract import arguments_json, new_call_id
from kvshard.outputs import CompletionOutput
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams

TEMPLATES = Path(__file__).parent / "templates"


def chat_template_for(given: str | None, tokenizer, conversation: list[dict[str, Any]],
                      tools: list[dict] | None) -> str | None:
    """The template a conversation is rendered with (the chat route's and `LLM.chat`'s): `given` (--chat-template)
    if any; else the tokenizer's own, or kvshard's tools-capable one for a model whose own template has no tools,
    when the conversation brings tools or tool turns (None: the tokenizer's own)."""
    if given is not None:
        return given
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        return DEFAULT_CHAT_TEMPLATE
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
        return shipped_template(own)
    return None


def shipped_template(own: str | None) -> str | None:
    """A tools-capable template kvshard ships for a model whose own template has no tools (SmolLM2-Instruct)."""
    if isinstance(own, str) and "tools" not in own and "<|im_start|>" in own and "SmolLM" in own:
        return (TEMPLATES / "smollm2_tools.jinja").read_text()
    return None


def tool_constraint(tools: list[ChatTool], mode: str, named: str | None,
                    parallel: bool) -> StructuredOutputsParams | None:
    """What the model must write for tool_choice "required" (a JSON array of calls, one call unless parallel
    calls are allowed) or a named function (its arguments object)."""
    if mode == "named":
        index, function = next((i, tool.function) for i, tool in enumerate(tools) if tool.function.name == named)
        return _tools_constraint(function.schema_(), f"tools.{index}.function.parameters")
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": tool.function.schema_()},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return _tools_constraint(array, "tools")


def _tools_constraint(schema: dict[str, Any], param: str) -> StructuredOutputsParams:
    """The constraint of a schema made from the tools; one the constraint's limits refuse (a schema longer than
    MAX_CONSTRAINT_CHARS) is a 400 naming the tools."""
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as error:
        words = str(error).removeprefix("structured_outputs.json").strip()
        said = param if param != "tools" else "tools: the schema of the calls, made from every tool's parameters,"
        raise APIError(400, f"{said} {words}", param) from None


def chat_message(text: str, finish_reason: str | None, parser: ToolParser | None, mode: str,
                 max_calls: int | None) -> tuple[dict[str, Any], str | None]:
    """A finished choice's message (content and tool_calls, OpenAI's shape) and its finish_reason: "tool_calls"
    when the model stopped after calling (auto, required), "stop" for a named function, as OpenAI answers."""
    if parser is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parser.parse(text, final=True)
    calls = [call for call in parsed.calls if call.name][:max_calls]
    if not calls:  # "required" writes no text for the user: an output cut before a call was named has none
        return {"role": "assistant", "content": (parsed.content or None) if mode == "required" else text}, finish_reason
    tool_calls = [{"id": call.id or new_call_id(), "type": "function",
                   "function": {"name": call.name, "arguments": arguments_json(call)}} for call in calls]
    if finish_reason == "stop" and mode != "named":
        finish_reason = "tool_calls"
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}, finish_reason


class ChatServing:
    """The chat route (a mixin of OpenAIServer); the Responses API generates through it too."""

    async def chat_inputs(self, request: Request) -> tuple[ChatCompletionRequest, SamplingParams, list[list[int]]]:
        """A chat request checked as a whole, templated and tokenized (see completion_inputs)."""
        body = _parse(ChatCompletionRequest, await request.body(), self._max_items("messages", "tools"))
        self._check_request(body, request)
        params, prompts = await self._chat_prepare(body)
        return body, params, prompts

    async def _chat_prepare(self, body: ChatCompletionRequest,
                            constraint: tuple[StructuredOutputsParams | None, str | None] | None = None,
                            ) -> tuple[SamplingParams, list[list[int]]]:
        """Sampling parameters (with the output constraint: the request's own, or its tools') and the tokenized
        conversation; every 400 found before anything reaches the engine."""
        mode = body.tool_mode
        if mode == "auto" and self.tool_parser is None:
            raise APIError(400, 'tool_choice "auto" (the default when tools are given) needs a server started with '
                                "--enable-auto-tool-choice --tool-call-parser NAME; or use tool_choice "
                                '"required", a named function or "none"', "tool_choice")
        asked, field = constraint if constraint is not None else body.constraint()
        from_tools = tool_constraint(body.tools or [], mode, body.named_tool, body.parallel_tool_calls is not False)
        if from_tools is not None:
            if asked is not None:
                chosen = f'naming function "{body.named_tool}"' if body.named_tool else repr(body.tool_choice)
                raise APIError(400, f"{field} cannot be combined with tool_choice {chosen}: the tool "
                                    "calls are the output", field)
            asked, field = body.with_whitespace_option(from_tools), "tools"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, asked,
                                      self.sampling_defaults)  # --generation-config (Responses too)
        self._check_choices(1, params.n)
        try:
            await self._check_constraint(asked, field)
        except APIError:
            if field == "tools":  # said of the tool the client wrote, not of the calls' schema built around it
                await self._check_tool_schemas(body, mode)
            raise
        tools = [tool.function.for_template() for tool in body.tools] if body.tools else None
        rendered = await self._render_chat([m.for_template() for m in body.messages], tools,
                                           body.add_generation_prompt, body.continue_final_message)
        # a max_tokens the request did not give (the generation config's max_new_tokens) is a limit, as vLLM's: it
        # leaves the prompt the room it needs rather than refusing it
        default_cap = params.max_tokens if max_tokens is None else None
        if default_cap is not None:
            params.max_tokens = None
        prompts = await self._tokenize([rendered], params, "messages")
        if default_cap is not None:
            params.max_tokens = max(1, min(default_cap, self.max_model_len - len(prompts[0])))
        return params, prompts

    async def _check_tool_schemas(self, body: ChatCompletionRequest, mode: str) -> None:
        """The first tool whose parameters alone do not compile (of those `mode` constrains to): a 400 naming
        it, `tools.N.function.parameters`, with the place inside its own schema."""
        for index, tool in enumerate(body.tools or []):
            if mode == "named" and tool.function.name != body.named_tool:
                continue
            alone = body.with_whitespace_option(StructuredOutputsParams(json=tool.function.schema_()))
            await self._check_constraint(alone, f"tools.{index}.function.parameters")

    def _tool_parser_for(self, body: ChatCompletionRequest) -> tuple[ToolParser | None, str, int | None]:
        mode = body.tool_mode
        parser = {"none": None, "auto": self.tool_parser, "required": RequiredToolParser()}.get(mode)
        if mode == "named":
            parser = NamedToolParser(body.named_tool)
        return parser, mode, 1 if body.parallel_tool_calls is False else None

    async def chat_completions(self, request: Request) -> Response:
        body, params, prompts = await self.chat_inputs(request)
        self._check_alive()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        envelope = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": body.model}
        top = body.top_logprobs or 0
        parser, mode, max_calls = self._tool_parser_for(body)

        if body.stream:
            roles = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for index in range(params.n)]
            streams: dict[int, ToolCallStream] = {}
            texts: dict[int, str] = {}
            cursors: dict = {}  # each choice's place in its text, across chunks

            def shape(delta) -> dict | None:
                logprobs = self._chat_logprobs(delta.token_ids, delta.logprobs, top, cursors, delta.index)
                if parser is None:
                    return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                            "logprobs": logprobs, "finish_reason": delta.finish_reason}
                texts[delta.index] = texts.get(delta.index, "") + delta.text
                stream = streams.setdefault(delta.index, ToolCallStream(parser, max_calls))
                content, calls = stream.feed(texts[delta.index], delta.finish_reason is not None)
                shaped: dict[str, Any] = {}
                if content:
                    shaped["content"] = content
                if calls:
                    shaped["tool_calls"] = calls
                finish = delta.finish_reason
                if finish == "stop" and stream.sent and mode != "named":
                    finish = "tool_calls"
                if not shaped and finish is None and logprobs is None:
                    return None
                return {"index": delta.index, "delta": shaped, "logprobs": logprobs, "finish_reason": finish}

            return self._stream(envelope, request_id, prompts, params, body.include_usage, shape, first_choices=roles,
                                continuous_usage=body.continuous_usage)

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, request_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)
        completions: list[CompletionOutput] = outputs[0].outputs
        choices = []
        for c in completions:
            message, finish_reason = chat_message(c.text, c.finish_reason, parser, mode, max_calls)
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top),
                            "finish_reason": finish_reason})
        usage = _usage(prompts, sum(len(c.token_ids) for c in completions), _cached_tokens(outputs))
        return JSONResponse({**envelope, "object": "chat.completion", "choices": choices, "usage": usage})

    async def _render_chat(self, conversation: list[dict[str, Any]], tools: list[dict] | None,
                           add_generation_prompt: bool, continue_final_message: bool = False) -> list[int]:
        """The conversation templated and tokenized, off the event loop; one too long to fit is refused first.
        With `continue_final_message` the last message is left open (transformers' option of the same name)."""
        check_continue_final_message(continue_final_message, add_generation_prompt)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot chat: use /v1/completions with token ids",
                           "messages")
        chars = sum(len(m["content"]) for m in conversation) + len(json.dumps(tools or []))
        if chars > self.max_prompt_chars:
            raise APIError(400, f"messages: {chars:,} characters cannot fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", "messages")
        template = chat_template_for(self.chat_template, self.tokenizer, conversation, tools)

        def render() -> str:
            try:
                text = self.tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template,
                                                          tokenize=False, add_generation_prompt=add_generation_prompt,
                                                          continue_final_message=continue_final_message)
            except Exception as error:  # the template rejected the conversation (e.g. role order)
                raise APIError(400, f"the chat template cannot render these messages: {error}", "messages") from None
            self._check_prompt_length(text, "messages")
            # the template writes the special tokens itself
            return self.tokenizer.encode(text, add_special_tokens=False)

        return await asyncio.to_thread(render)
