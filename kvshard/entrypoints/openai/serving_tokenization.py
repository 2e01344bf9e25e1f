"""vLLM's POST /tokenize and POST /detokenize: a prompt (or a conversation, through the chat template) to token
ids, and token ids to text, with this server's tokenizer; off the event loop."""

from __future__ import annotations

import asyncio

from fastapi import Request

from kvshard.entrypoints.openai.protocol import APIError, DetokenizeRequest, TokenizeRequest, _parse, check_messages


class TokenizationServing:
    """The tokenizer routes (a mixin of OpenAIServer)."""

    def _check_tokenizer_request(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")

    async def tokenize(self, request: Request) -> dict:
        body = _parse(TokenizeRequest, await request.body(), self._max_items("messages", "tools"))
        self._check_tokenizer_request(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give one of prompt and messages", "prompt")
        if body.messages is not None:
            check_messages(body.messages)  # as chat renders them
            tools = [tool.function.for_template() for tool in body.tools] if body.tools else None
            tokens = await self._render_chat([m.for_template() for m in body.messages], tools,
                                             body.add_generation_prompt, body.continue_final_message)
        else:
            self._check_prompt_length(body.prompt, "prompt")
            tokens = await asyncio.to_thread(self.tokenizer.encode, body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        strs = await asyncio.to_thread(self.tokenizer.convert_ids_to_tokens, tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens, "token_strs": strs}

    async def detokenize(self, request: Request) -> dict:
        body = _parse(DetokenizeRequest, await request.body())
        self._check_tokenizer_request(body.model)
        if any(not 0 <= t < self.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {self.vocab_size})", "tokens")
        if len(body.tokens) > self.max_model_len:
            raise APIError(400, f"tokens: {len(body.tokens):,} token ids are more than this model's maximum context "
                                f"length of {self.max_model_len}", "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)}
