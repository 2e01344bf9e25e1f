"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvshard.entrypoints.openai.protocol import CompletionRequest, _parse
from kvshard.entrypoints.openai.serving_engine import (_cached_tokens, _ChoiceDelta, _final_outputs,
                                                       _unless_disconnected, _usage)
from kvshard.sampling_params import SamplingParams


class CompletionServing:
    """The completion route (a mixin of OpenAIServer)."""

    async def completion_inputs(self, request: Request) -> tuple[CompletionRequest, SamplingParams, list[list[int]]]:
        """A completion request checked as a whole and tokenized: what /v1/completions generates from (and
        what a disaggregated consumer's check route answers for before its producer prefills)."""
        body = _parse(CompletionRequest, await request.body(), self._max_items())
        self._check_request(body, request)
        constraint, field = body.constraint()
        params = body.sampling_params(body.max_tokens, body.logprobs, constraint, self.sampling_defaults)
        await self._check_constraint(constraint, field)
        raw_prompts = _raw_prompts(body)
        self._check_choices(len(raw_prompts), params.n)
        return body, params, await self._tokenize(raw_prompts, params, "prompt")

    async def completions(self, request: Request) -> Response:
        body, params, prompts = await self.completion_inputs(request)
        self._check_alive()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        envelope = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}
        echoed = await self._prompt_texts(_raw_prompts(body), prompts) if body.echo else None
        show_output = not body.echo_only

        echoes: dict = {}  # prompt index -> its echoed logprobs, shaped once for its n choices

        if body.stream:
            cursors: dict = {}  # each choice's place in its text, for text_offset across chunks

            def shape(delta: _ChoiceDelta) -> dict:
                if delta.echo:
                    logprobs = self._echoed_logprobs(echoes, delta.prompt_index, delta.token_ids, delta.logprobs,
                                                     cursors, delta.index)
                    return {"index": delta.index, "text": echoed[delta.prompt_index], "logprobs": logprobs,
                            "finish_reason": None}
                return {"index": delta.index, "text": delta.text,
                        "logprobs": self._completion_logprobs(delta.token_ids, delta.logprobs, cursors, delta.index),
                        "finish_reason": delta.finish_reason}

            return self._stream(envelope, request_id, prompts, params, body.include_usage, shape,
                                continuous_usage=body.continuous_usage, echo=body.echo, show_output=show_output)

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, request_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)  # the client is gone

        def shape_choices() -> tuple[list[dict], int]:
            choices, completion_tokens = [], 0
            for prompt_index, output in enumerate(outputs):
                for c in output.outputs:
                    index = prompt_index * params.n + c.index
                    text, token_ids, logprobs, finish_reason = c.text, c.token_ids, c.logprobs, c.finish_reason
                    if not show_output:  # max_tokens 0: the token sampled is not part of the answer
                        text, token_ids, finish_reason = "", [], "length"
                        logprobs = [] if logprobs is not None else None
                    completion_tokens += len(token_ids)
                    cursors: dict = {}
                    shaped_prompt = None
                    if echoed is not None:
                        text = echoed[prompt_index] + text
                        shaped_prompt = self._echoed_logprobs(
                            echoes, prompt_index, output.prompt_token_ids,
                            output.prompt_logprobs if logprobs is not None else None, cursors, index)
                    shaped = self._completion_logprobs(token_ids, logprobs, cursors, index)
                    if shaped_prompt is not None:
                        shaped = {key: shaped_prompt[key] + shaped[key] for key in shaped}
                    choices.append({"index": index, "text": text, "logprobs": shaped, "finish_reason": finish_reason})
            return choices, completion_tokens

        # a long echoed prompt's logprobs take a while to shape: off the event loop
        choices, completion_tokens = (await asyncio.to_thread(shape_choices) if body.logprobs is not None
                                      else shape_choices())
        usage = _usage(prompts, completion_tokens, _cached_tokens(outputs))
        return JSONResponse({**envelope, "choices": choices, "usage": usage})

    def _echoed_logprobs(self, echoes: dict, prompt_index: int, token_ids: list[int],
                         logprobs: list[dict[int, float] | None] | None, cursors: dict, index: int) -> dict | None:
        """An echoed prompt's logprobs, shaped once for all its choices (`echoes`, by prompt index), and choice
        `index`'s text cursor (in `cursors`) placed after the prompt's text."""
        if logprobs is None:
            return None
        if prompt_index not in echoes:
            own: dict = {}
            echoes[prompt_index] = (self._completion_logprobs(token_ids, logprobs, own, 0), own[0])
        shaped, cursor = echoes[prompt_index]
        cursors[index] = cursor.copy()
        return shaped

    async def _prompt_texts(self, raw_prompts: list[str | list[int]], prompts: list[list[int]]) -> list[str]:
        """What `echo` puts before each prompt's outputs: a text prompt as it was sent; token ids as the engine
        writes an output's text (decoded, special tokens left out; nothing for a model without a tokenizer)."""
        def text(raw: str | list[int], token_ids: list[int]) -> str:
            if isinstance(raw, str):
                return raw
            return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

        return await asyncio.to_thread(lambda: [text(r, p) for r, p in zip(raw_prompts, prompts)])


def _raw_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, one a string or a list of token ids."""
    raw = body.prompt
    return [raw] if isinstance(raw, str) or not raw or isinstance(raw[0], int) else raw
