"""POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvshard.entrypoints.openai.protocol import CompletionRequest, _parse
from kvshard.entrypoints.openai.serving_engine import _cached_tokens, _final_outputs, _unless_disconnected, _usage
from kvshard.sampling_params import SamplingParams


class CompletionServing:
    """The completion route (a mixin of OpenAIServer)."""

    async def completion_inputs(self, request: Request) -> tuple[CompletionRequest, SamplingParams, list[list[int]]]:
        """A completion request checked as a whole and tokenized: what /v1/completions generates from (and
        what a disaggregated consumer's check route answers for before its producer prefills)."""
        body = _parse(CompletionRequest, await request.body(), self._max_items())
        self._check_request(body, request)
        constraint, field = body.constraint()
        params = body.sampling_params(body.max_tokens, body.logprobs, constraint)
        await self._check_constraint(constraint, field)
        raw = body.prompt
        raw_prompts = [raw] if isinstance(raw, str) or not raw or isinstance(raw[0], int) else raw
        self._check_choices(len(raw_prompts), params.n)
        return body, params, await self._tokenize(raw_prompts, params, "prompt")

    async def completions(self, request: Request) -> Response:
        body, params, prompts = await self.completion_inputs(request)
        self._check_alive()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        envelope = {"id": request_id, "object": "text_completion", "created": created, "model": body.model}

        if body.stream:
            cursors: dict = {}  # each choice's place in its text, for text_offset across chunks
            return self._stream(envelope, request_id, prompts, params, body.include_usage, lambda delta: {
                "index": delta.index, "text": delta.text,
                "logprobs": self._completion_logprobs(delta.token_ids, delta.logprobs, cursors, delta.index),
                "finish_reason": delta.finish_reason}, continuous_usage=body.continuous_usage)

        outputs = await _unless_disconnected(request, _final_outputs(self.engine, request_id, prompts, params))
        if outputs is None:
            return Response(status_code=499)  # the client is gone
        choices, completion_tokens = [], 0
        for prompt_index, output in enumerate(outputs):
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                choices.append({"index": prompt_index * params.n + c.index, "text": c.text,
                                "logprobs": self._completion_logprobs(c.token_ids, c.logprobs),
                                "finish_reason": c.finish_reason})
        usage = _usage(prompts, completion_tokens, _cached_tokens(outputs))
        return JSONResponse({**envelope, "choices": choices, "usage": usage})
