"""What every generation route shares: the engine's outputs merged across a request's prompts, streamed as
deltas or awaited whole, a client's disconnect watched, SSE events, and the checks every request passes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from kvshard.engine.async_engine import AsyncLLMEngine
from kvshard.engine.llm_engine import EngineDeadError
from kvshard.entrypoints.openai.protocol import APIError, _engine_dead, _GenerationRequest, _request_failed
from kvshard.entrypoints.openai.token_bytes import TextCursor, token_bytes
from kvshard.outputs import RequestOutput
from kvshard.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("kvshard.server")


# --- generation -------------------------------------------------------------------------------

@dataclass
class _ChoiceDelta:
    """New output of one choice since the last chunk."""

    index: int  # prompt_index * n + the completion's index, as OpenAI numbers choices
    prompt_index: int
    num_cached_tokens: int  # of its prompt: tokens whose KV the prefix cache gave
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # None in the list: an echoed prompt's first token
    finish_reason: str | None
    echo: bool = False  # the choice's prompt (`token_ids`, its logprobs; the route knows its text), not output


async def _merged(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  stream: bool, max_backlog: int | None = None,
                  cut: asyncio.Event | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of every prompt as they come, tagged with the prompt's index; closing this aborts the rest.

    Outputs are cumulative, so only each prompt's newest one waits to be taken: a slow reader costs no
    memory. With `max_backlog`, a prompt whose newest output runs more tokens ahead of the last one
    taken is aborted (its KV blocks freed) and `cut` is set: its client has stopped reading.
    """
    newest: dict[int, RequestOutput | Exception] = {}
    taken: dict[int, int] = {}  # tokens of each prompt already handed out
    arrived = asyncio.Event()

    async def pump(index: int, prompt: list[int]) -> None:
        try:
            async with aclosing(engine.generate(f"{request_id}-{index}", prompt, params, stream)) as generator:
                async for output in generator:
                    newest[index] = output
                    arrived.set()
                    behind = _num_tokens(output) - taken.get(index, 0)
                    if max_backlog is not None and not output.finished and behind > max_backlog:
                        raise _StreamBacklog(f"{request_id}-{index}: the client stopped reading, {behind} tokens "
                                             f"behind (limit {max_backlog}); aborted")
        except Exception as error:  # leaving the generator above aborted the request
            newest[index] = error
            arrived.set()
            if isinstance(error, _StreamBacklog) and cut is not None:
                logger.warning("%s", error)
                cut.set()

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = set(range(len(prompts)))
        while remaining:
            await arrived.wait()
            arrived.clear()
            ready = sorted(newest.items(), key=lambda item: item[0])
            newest.clear()
            for index, item in ready:
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise _request_failed(item.error, item.invalid_request)
                taken[index] = _num_tokens(item)
                yield index, item
                if item.finished:
                    remaining.discard(index)
    finally:
        for task in tasks:
            task.cancel()


class _StreamBacklog(APIError):
    """A streaming client fell too far behind: its request was aborted (and its connection is cut, so
    this reaches the client only if it reads again before the cut)."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, code="stream_backlog", type="server_error")


def _num_tokens(output: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in output.outputs)


async def _deltas(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                  max_backlog: int, cut: asyncio.Event, interval: int = 1, echo: bool = False,
                  show_output: bool = True) -> AsyncIterator[_ChoiceDelta]:
    """Streaming: each choice's text as it becomes final.

    Held back until the choice ends: the last characters that might start a stop
    string, and an incomplete UTF-8 character (decoded as U+FFFD for now). After a
    choice's first delta, the next waits until `interval` tokens have come since the
    last one sent (`--stream-interval`), or the choice ends.

    `echo`: each choice's first delta is its prompt (`_ChoiceDelta.echo`), once the prompt's logprobs (where asked
    for) are all there. `show_output` False (completions' `echo` with `max_tokens: 0`): the output is left out, each
    choice ends with an empty delta of finish reason "length".
    """
    holdback = max((len(s) for s in params.stop), default=1) - 1
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    echoed: set[int] = set()
    async for prompt_index, output in _merged(engine, request_id, prompts, params, True, max_backlog, cut):
        for completion in output.outputs:
            index = prompt_index * params.n + completion.index
            if index in finished:
                continue  # the request goes on for its other choices
            cached = output.num_cached_tokens or 0
            if echo and index not in echoed:
                prompt_logprobs = output.prompt_logprobs
                if prompt_logprobs is not None and len(prompt_logprobs) < len(output.prompt_token_ids):
                    continue  # the request's first sequence is still computing them; a later output has them
                echoed.add(index)
                yield _ChoiceDelta(index, prompt_index, cached, "", list(output.prompt_token_ids), prompt_logprobs,
                                   None, echo=True)
            if not show_output:
                if completion.finished:
                    finished.add(index)
                    yield _ChoiceDelta(index, prompt_index, cached, "", [],
                                       [] if completion.logprobs is not None else None, "length")
                continue
            text = completion.text
            if completion.finished:
                finished.add(index)
            else:
                text = text[: len(text) - holdback].rstrip("\ufffd")
            first = sent_tokens.get(index, 0)
            if first and not completion.finished and len(completion.token_ids) - first < interval:
                continue  # a later delta carries these tokens
            delta = text[len(sent_text.get(index, "")):]
            if not delta and not completion.finished:
                continue
            sent_text[index], sent_tokens[index] = text, len(completion.token_ids)
            yield _ChoiceDelta(index, prompt_index, cached, delta, completion.token_ids[first:],
                               completion.logprobs[first:] if completion.logprobs is not None else None,
                               completion.finish_reason)


async def _final_outputs(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]],
                         params: SamplingParams) -> list[RequestOutput]:
    final: dict[int, RequestOutput] = {}
    async for index, output in _merged(engine, request_id, prompts, params, stream=False):
        final[index] = output
    return [final[i] for i in range(len(prompts))]


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work) -> asyncio.Task:
    """Run `work`, cancelled (and unwound: its request aborted) if the client hangs up first; the task, done."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task


async def _unless_disconnected(request: Request, work):
    """`work`'s result, or None if the client hung up first (the work then cancelled)."""
    task = await until_disconnected(request, work)
    return None if task.cancelled() else task.result()


def _usage(prompts: list[list[int]], completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens the prefix cache served (their KV was not computed)."""
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _cached_tokens(outputs: list[RequestOutput]) -> int:
    return sum(output.num_cached_tokens or 0 for output in outputs)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


class _CuttableStream(StreamingResponse):
    """An event stream that stops, resetting its connection, once `cut` is set (its client stopped reading,
    so a last event could not reach it anyway)."""

    def __init__(self, content: AsyncIterator[str], cut: asyncio.Event) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.cut = cut

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(super().__call__(scope, receive, send))
        cut = asyncio.ensure_future(self.cut.wait())
        try:
            await asyncio.wait({stream, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut.cancel()
            stream.cancel()  # stuck writing to a client that does not read
        await asyncio.gather(stream, return_exceptions=True)
        if self.cut.is_set():
            reset_connection(scope)
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()


TRANSPORT_EXTENSION = "kvshard.transport"


def with_connection_transport(app):
    """The ASGI app, told its connection's transport (scope["extensions"]["kvshard.transport"]).

    A closed connection is only closed once the client has read what the server queued for it: for a
    client that stopped reading, minutes, or never. To cut such a connection the server needs its
    transport, which ASGI does not give: uvicorn's `send` is a method of the object that holds it.
    Without that (another server), connections close as the server closes them. The transport is taken by
    what it does, not by its class: uvloop's (uvicorn's loop where uvloop is installed) is no asyncio.Transport.
    """
    async def app_with_transport(scope, receive, send) -> None:
        transport = getattr(getattr(send, "__self__", None), "transport", None)
        if scope["type"] == "http" and all(callable(getattr(transport, name, None))
                                           for name in ("abort", "is_closing", "get_extra_info")):
            scope = {**scope, "extensions": {**(scope.get("extensions") or {}), TRANSPORT_EXTENSION: transport}}
        await app(scope, receive, send)

    return app_with_transport


def reset_connection(scope) -> None:
    """Drop the connection now, with what is queued for its client (a TCP reset, not a close that waits
    for the client to read)."""
    transport = (scope.get("extensions") or {}).get(TRANSPORT_EXTENSION)
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() resets
    transport.abort()




class ServingBase:
    """The checks and helpers every route shares (OpenAIServer holds the state they read)."""

    def _check_request(self, request: _GenerationRequest, http: Request | None = None) -> None:
        if request.model not in self.model_names:
            raise APIError(404, f"The model `{request.model}` does not exist.", "model", "model_not_found")
        request.check_supported()
        if request.kv_transfer_params is not None:
            if self.check_kv_transfer is None:
                raise APIError(400, "kv_transfer_params needs a server started with --kv-transfer-config",
                               "kv_transfer_params")
            request.kv_transfer_params = self.check_kv_transfer(request.kv_transfer_params,
                                                                http.headers if http is not None else {})

    def _check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_choices_per_request:
            param = "n" if n > 1 else "prompt"
            raise APIError(400, f"{param}: {num_prompts} prompts x n={n} ask for {num_prompts * n} choices, more "
                                f"than {self.max_choices_per_request} per request (--max-choices-per-request)",
                           param)

    def _max_items(self, *rendered: str) -> dict[str, tuple[int, str]]:
        """What `_parse` counts in a large body: the `rendered` fields' items (messages, input items, tools) each
        put at least one token into the prompt, and `logit_bias` names distinct token ids of the vocabulary."""
        fit = (self.max_model_len, f"items cannot fit in this model's maximum context length of {self.max_model_len} "
                                   "tokens (each takes at least one)")
        return {**dict.fromkeys(rendered, fit),
                "logit_bias": (self.vocab_size, f"keys: more than the vocabulary's {self.vocab_size:,} token ids")}

    def _check_prompt_length(self, prompt: str | list[int], param: str) -> None:
        """What cannot fit in max_model_len tokens, refused before any tokenizing."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise APIError(400, f"{param}: {len(prompt):,} characters cannot fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", param)
        if isinstance(prompt, list) and len(prompt) >= self.max_model_len:
            raise APIError(400, f"{param}: {len(prompt):,} token ids do not fit in this model's maximum context "
                                f"length of {self.max_model_len} tokens", param)

    async def _tokenize(self, prompts: list[str | list[int]], params: SamplingParams, param: str) -> list[list[int]]:
        """Every prompt checked and tokenized, off the event loop (a long prompt takes seconds)."""
        for prompt in prompts:
            if isinstance(prompt, str) and self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param)
            self._check_prompt_length(prompt, param)
        try:
            return await asyncio.to_thread(lambda: [self.validate_prompt(p, params) for p in prompts])
        except ValueError as error:
            field = str(error).split()[0].rstrip(":")  # the fields checked against the model (or the KV transfer)
            named = ("logit_bias", "bad_words", "min_tokens", "structured_outputs", "stop_token_ids")  # name themselves
            raise APIError(400, str(error), field if field in named else param) from None

    def _check_alive(self) -> None:
        if self.engine.refusal is not None:
            raise _engine_dead(self.engine.refusal)

    def _stream(self, envelope: dict, request_id: str, prompts: list[list[int]], params: SamplingParams,
                include_usage: bool, choice: Callable[[_ChoiceDelta], dict | None],
                first_choices: list[dict] | None = None, continuous_usage: bool = False, echo: bool = False,
                show_output: bool = True) -> StreamingResponse:
        """SSE: `first_choices` one event each, then one event per delta (shaped by `choice`), the usage
        if asked for, an error event if the engine dies or the request fails, and [DONE]. `echo`, `show_output`:
        as `_deltas` takes them (an echoed prompt's tokens are not completion tokens).

        With `include_usage`, as OpenAI: every chunk has `usage`, null but in the last one (`choices: []`); with
        `continuous_usage` (vLLM's `continuous_usage_stats`) each chunk's is the request's usage so far."""
        cut = asyncio.Event()
        completion_tokens = 0
        cached_tokens: dict[int, int] = {}  # per prompt

        def event(choices: list[dict], final: bool = False) -> str:
            if not include_usage:
                return _sse({**envelope, "choices": choices})
            usage = (_usage(prompts, completion_tokens, sum(cached_tokens.values()))
                     if final or continuous_usage else None)
            return _sse({**envelope, "choices": choices, "usage": usage})

        async def events() -> AsyncIterator[str]:
            nonlocal completion_tokens
            for first in first_choices or []:
                yield event([first])
            try:
                async for delta in _deltas(self.engine, request_id, prompts, params, self.max_stream_backlog, cut,
                                           self.stream_interval, echo, show_output):
                    if not delta.echo:
                        completion_tokens += len(delta.token_ids)
                    cached_tokens[delta.prompt_index] = delta.num_cached_tokens
                    shaped = choice(delta)
                    if shaped is not None:  # None: nothing to send yet (a tool call's text held back)
                        yield event([shaped])
                if include_usage:
                    yield event([], final=True)
            except EngineDeadError as error:
                yield _sse(_engine_dead(str(error)).body())
            except APIError as error:
                yield _sse(error.body())
            yield _sse("[DONE]")

        return _CuttableStream(events(), cut)


    def _token_text(self, token_id: int, data: bytes | None = None) -> str:
        """A token's text: its bytes (`data`: as they stand at that point of the output) decoded, a piece of a
        multi-byte character read as U+FFFD; a special token's, its own text."""
        if data is None:
            data = self._token_bytes().raw(token_id)
        return data.decode("utf-8", "replace")

    def _token_bytes(self):
        return token_bytes(self.tokenizer, getattr(self, "vocab_size", None), getattr(self, "stop_token_ids", None))

    def _text_cursor(self, cursors: dict | None, index: int):
        """The cursor of choice `index` through its output text (`cursors`: a stream's, kept across its chunks;
        None: a fresh one, for a whole output)."""
        cursor = cursors.get(index) if cursors is not None else None
        if cursor is None:
            cursor = TextCursor(self._token_bytes())
            if cursors is not None:
                cursors[index] = cursor
        return cursor

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None] | None,
                             cursors: dict | None = None, index: int = 0) -> dict | None:
        """Completions' logprobs; `text_offset`: each token's character offset in the choice's whole text (a
        stream's chunks go on from the text before them, as vLLM's), from the tokens' raw bytes: a token that
        starts inside a character gets that character's offset, a special token (not in the text) where it is.
        An entry None (an echoed prompt's first token, which nothing predicts): its logprob and top_logprobs null,
        as OpenAI's."""
        if logprobs is None:
            return None
        cursor = self._text_cursor(cursors, index)
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            if entry is None:
                top_logprobs.append(None)
            else:
                top_logprobs.append({self._token_text(i, cursor.bytes_at(i)): lp for i, lp in entry.items()})
            offset, data = cursor.advance(token_id)
            tokens.append(self._token_text(token_id, data))
            token_logprobs.append(None if entry is None else entry[token_id])
            offsets.append(offset)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, top: int,
                       cursors: dict | None = None, index: int = 0) -> dict | None:
        """Chat's logprobs: each token's (and each alternative's) raw `bytes`, so that the content tokens' bytes
        joined are the content's UTF-8 (a special token's: its text's); `token`, those bytes decoded."""
        if logprobs is None:
            return None
        cursor = self._text_cursor(cursors, index)

        def item(token_id: int, logprob: float, data: bytes) -> dict:
            return {"token": self._token_text(token_id, data), "logprob": logprob, "bytes": list(data)}

        content = []
        for token_id, entry in zip(token_ids, logprobs):
            best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
            alternatives = [item(i, lp, cursor.bytes_at(i)) for i, lp in best]
            _, data = cursor.advance(token_id)
            content.append({**item(token_id, entry[token_id], data), "top_logprobs": alternatives})
        return {"content": content}


    async def _check_constraint(self, constraint: StructuredOutputsParams | None, param: str | None) -> None:
        """A constraint the grammar backend cannot compile (an invalid schema, a regex or grammar it cannot
        parse) is a 400 naming its field, found before the request reaches the engine; off the event loop."""
        if constraint is None:
            return
        check = self.check_structured_outputs
        try:
            await asyncio.to_thread(check, constraint)
        except (ValueError, RuntimeError) as error:
            # the backend's own words, without its source location ("[time] file.cc:line: "), said of the field
            # the request used ("structured_outputs.json could not be compiled: ..." of response_format's schema)
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error).strip()) or type(error).__name__
            engine_words = re.match(r"structured_outputs(?:\.\w+)? (.*)", message, re.S)
            text = f"{param} {engine_words.group(1)}" if engine_words else f"{param}: {message}"
            raise APIError(400, text, param) from None
