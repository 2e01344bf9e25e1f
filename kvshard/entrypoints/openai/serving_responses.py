"""POST /v1/responses: the subset of OpenAI's Responses API that the OpenAI Agents SDK uses.

A request becomes a chat conversation (instructions first, as a system message; `function_call` items as an
assistant turn's tool calls, `function_call_output` items as tool messages) and generates through the chat
route's machinery: the same template, tools and constraints. `previous_response_id` continues a conversation
this server still remembers: the last `max_stored_responses` responses (store: true, the default), the least
recently used forgotten first; an id it no longer holds is a 400.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvshard.engine.llm_engine import EngineDeadError
from kvshard.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, ResponsesRequest, _engine_dead,
                                                 _parse, response_format_constraint)
from kvshard.entrypoints.openai.serving_chat import chat_message
from kvshard.entrypoints.openai.serving_engine import (_cached_tokens, _CuttableStream, _deltas, _final_outputs,
                                                       _unless_disconnected)
from kvshard.entrypoints.openai.tool_parsers import ToolCallStream

DEFAULT_MAX_STORED_RESPONSES = 1024


class ResponseStore:
    """The conversations of the last `capacity` responses (their chat messages, output included), by id;
    least recently used first out."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._conversations: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        conversation = self._conversations.get(response_id)
        if conversation is not None:
            self._conversations.move_to_end(response_id)
        return conversation

    def put(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self._conversations[response_id] = conversation
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)

    def __len__(self) -> int:
        return len(self._conversations)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of text parts", where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.{index}: only text parts (input_text, output_text) are supported by "
                                f"kvshard, got {kind!r}", f"{where}.{index}")
        texts.append(part["text"])
    return "\n".join(texts)


def _string_field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages (OpenAI's chat shape)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(value):
        where = f"input.{index}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string_field(item, "call_id", where), "type": "function",
                    "function": {"name": _string_field(item, "name", where),
                                 "arguments": _string_field(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string_field(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # kvshard's models write none; one sent back says nothing the model needs
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported by kvshard (message, function_call and "
                                "function_call_output are)", f"{where}.type")
    return messages


# the chat request's fields that the Responses request's own stand for (the conversation: instructions, the stored
# history and input, so a message's index there is not the input item's)
_RESPONSES_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


def _in_responses_names(error: APIError) -> APIError:
    """An error the chat route found in the chat request that a Responses request became, named as the client
    wrote it."""
    head = (error.param or "").split(".")[0]
    function = re.match(r"tools\.\d+\.function(?=\.|$)", error.param or "")
    if function:  # a tool's fields: flat in the Responses API's tools
        flat = function.group(0).removesuffix(".function")
        return APIError(error.status, error.message.replace(function.group(0), flat),
                        flat + (error.param or "")[function.end():], error.code, error.type)
    if head not in _RESPONSES_NAMES:
        return error
    name = _RESPONSES_NAMES[head]
    path, colon, rest = error.message.partition(":")
    message = f"{name}:{rest}" if colon and path.split(".")[0] == head else error.message.replace(head, name, 1)
    return APIError(error.status, message, name, error.code, error.type)


class ResponsesServing:
    """The Responses route (a mixin of OpenAIServer)."""

    async def responses(self, request: Request) -> Response:
        body = _parse(ResponsesRequest, await request.body(), self._max_items("input", "tools"))
        if body.model not in self.model_names:
            raise APIError(404, f"The model `{body.model}` does not exist.", "model", "model_not_found")
        body.check_supported()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.response_store.get(body.previous_response_id)
            if stored is None:
                raise APIError(400, f"previous_response_id: no response {body.previous_response_id!r} is held by "
                                    f"this server (it keeps the last {self.response_store.capacity})",
                               "previous_response_id")
            history = stored
        conversation = history + input_messages(body.input)
        if not conversation:
            raise APIError(400, "input: give at least one message", "input")
        messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
        constraint = (None, None)
        if body.text is not None and body.text.format is not None:
            constraint = (response_format_constraint(body.text.format, "text.format"), "text.format")
        tool_choice = body.tool_choice
        if tool_choice is not None and not isinstance(tool_choice, str):
            tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
        chat = {"model": body.model, "messages": messages, "stream": body.stream}
        for key, value in (("tools", [t.as_chat_tool().model_dump(exclude_none=True) for t in body.tools or []]),
                           ("tool_choice", tool_choice), ("parallel_tool_calls", body.parallel_tool_calls),
                           ("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                           ("top_p", body.top_p), ("seed", body.seed),
                           ("structured_outputs", body.structured_outputs)):
            if value not in (None, []):
                chat[key] = value
        try:
            chat_body = _parse(ChatCompletionRequest, json.dumps(chat).encode())
            chat_body.check_supported()
            params, prompts = await self._chat_prepare(chat_body, (chat_body.with_whitespace_option(constraint[0]),
                                                                   constraint[1]))
        except APIError as error:
            raise _in_responses_names(error) from None
        self._check_alive()
        parser, mode, max_calls = self._tool_parser_for(chat_body)
        response_id = f"resp_{uuid.uuid4().hex}"
        shell = {"id": response_id, "object": "response", "created_at": int(time.time()), "model": body.model,
                 "instructions": body.instructions, "metadata": body.metadata or {},
                 "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
                 # OpenAI's default when none is given ("auto"): the field is never null in a response
                 "tool_choice": ("auto" if body.tool_choice is None else
                                 body.tool_choice if isinstance(body.tool_choice, str) else
                                 body.tool_choice.model_dump()),
                 "parallel_tool_calls": body.parallel_tool_calls is not False,
                 "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                 "previous_response_id": body.previous_response_id, "text": {"format": (body.text.format if body.text
                                                                                        and body.text.format else
                                                                                        {"type": "text"})},
                 "truncation": "disabled", "error": None, "incomplete_details": None, "store": body.store}

        def finish(message: dict[str, Any], finish_reason: str | None, output: list[dict], usage: dict) -> dict:
            if body.store:
                self.response_store.put(response_id, conversation + [message])
            incomplete = finish_reason == "length"
            return {**shell, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}

        if body.stream:
            return self._responses_stream(shell, response_id, prompts, params, parser, mode, max_calls, finish)

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, response_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)
        completion = outputs[0].outputs[0]
        message, finish_reason = chat_message(completion.text, completion.finish_reason, parser, mode, max_calls)
        output = []
        if message.get("content"):
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
        for call in message.get("tool_calls", []):
            output.append(_call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"],
                                     call["function"]["arguments"], "completed"))
        if finish_reason == "length" and output:  # the item the token budget cut, as OpenAI marks it
            output[-1]["status"] = "incomplete"
        usage = _responses_usage(prompts, len(completion.token_ids), _cached_tokens(outputs))
        return JSONResponse(finish(message, finish_reason, output, usage))

    def _responses_stream(self, shell, response_id, prompts, params, parser, mode, max_calls, finish):
        """OpenAI's Responses events: response.created and .in_progress; for the message, output_item.added,
        content_part.added, output_text.delta..., output_text.done, content_part.done, output_item.done; for
        each function call, output_item.added, function_call_arguments.delta..., .done, output_item.done; then
        response.completed (or response.incomplete, or an error event)."""
        cut = asyncio.Event()
        state = {"sequence": 0}

        def event(kind: str, **fields) -> str:
            payload = {"type": kind, "sequence_number": state["sequence"], **fields}
            state["sequence"] += 1
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            yield event("response.created", response={**shell, "status": "in_progress", "output": [], "usage": None})
            yield event("response.in_progress", response={**shell, "status": "in_progress", "output": [],
                                                          "usage": None})
            output: list[dict] = []
            message_item: dict | None = None  # the open message item
            text = ""
            content = ""
            calls: dict[int, dict] = {}  # call index -> its item
            stream = ToolCallStream(parser, max_calls) if parser is not None else None
            finish_reason, tokens, cached = None, 0, 0

            def close_message(status: str = "completed") -> list[str]:
                nonlocal message_item
                if message_item is None:
                    return []
                index = output.index(message_item)
                item = _message_item(message_item["id"], content, status)
                output[index] = item
                part = item["content"][0]
                message_item = None
                return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=content, logprobs=[]),
                        event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=part),
                        event("response.output_item.done", output_index=index, item=item)]

            def close_calls(status: str = "completed") -> list[str]:
                done = []
                for item in calls.values():
                    if item["status"] == "in_progress":
                        item["status"] = status
                        index = output.index(item)
                        done += [event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]),
                                 event("response.output_item.done", output_index=index, item=item)]
                return done

            try:
                async for delta in _deltas(self.engine, response_id, prompts, params, self.max_stream_backlog, cut,
                                           self.stream_interval):
                    tokens += len(delta.token_ids)
                    cached = delta.num_cached_tokens
                    text += delta.text
                    final = delta.finish_reason is not None
                    if stream is not None:
                        new_content, call_deltas = stream.feed(text, final)
                    else:
                        new_content, call_deltas = delta.text, []
                    if new_content and not calls:
                        if message_item is None:
                            message_item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}",
                                            "status": "in_progress", "role": "assistant", "content": []}
                            output.append(message_item)
                            index = len(output) - 1
                            yield event("response.output_item.added", output_index=index, item=message_item)
                            yield event("response.content_part.added", item_id=message_item["id"],
                                        output_index=index, content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []})
                        content += new_content
                        yield event("response.output_text.delta", item_id=message_item["id"],
                                    output_index=output.index(message_item), content_index=0, delta=new_content,
                                    logprobs=[])
                    for call in call_deltas:
                        if "id" in call:
                            for line in close_message() + close_calls():
                                yield line
                            item = _call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"], "",
                                              "in_progress")
                            calls[call["index"]] = item
                            output.append(item)
                            yield event("response.output_item.added", output_index=len(output) - 1, item=item)
                        fragment = call["function"].get("arguments", "")
                        if fragment:
                            item = calls[call["index"]]
                            item["arguments"] += fragment
                            yield event("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=output.index(item), delta=fragment)
                    if final:
                        finish_reason = delta.finish_reason
                # what is still open at the end is what the token budget cut, where it did (as OpenAI marks it)
                last = "incomplete" if finish_reason == "length" else "completed"
                for line in close_message(last) + close_calls(last):
                    yield line
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = [{"id": item["call_id"], "type": "function",
                                              "function": {"name": item["name"], "arguments": item["arguments"]}}
                                             for item in calls.values()]
                response = finish(message, finish_reason, output, _responses_usage(prompts, tokens, cached))
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield event(kind, response=response)
            except EngineDeadError as error:
                yield event("error", **_error_fields(_engine_dead(str(error))))
            except APIError as error:
                yield event("error", **_error_fields(error))

        return _CuttableStream(events(), cut)


def _error_fields(error: APIError) -> dict:
    return {"code": error.code, "message": error.message, "param": error.param}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _responses_usage(prompts: list[list[int]], output_tokens: int, cached_tokens: int) -> dict:
    input_tokens = sum(len(p) for p in prompts)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}

