"""`LLM`: offline batched generation, as vLLM users know it."""

from __future__ import annotations

import atexit
import uuid
import weakref
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from kvshard.config import ConfigError, EngineConfig
from kvshard.engine.arg_utils import EngineArgs
from kvshard.engine.llm_engine import LLMEngine
from kvshard.models.demo import DEFAULT_DEMO_MODEL
from kvshard.outputs import RequestOutput
from kvshard.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Start every rank and keep them until `close()` (or the end of the `with` block or process).

    >>> llm = LLM("kvshard-demo", tensor_parallel_size=2, decode_context_parallel_size=2)
    >>> out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    """

    def __init__(self, model: str = DEFAULT_DEMO_MODEL, **kwargs: Any) -> None:
        """`kwargs` are the settings of `EngineArgs` (the CLI flags in snake case, e.g. `max_model_len`)."""
        args = EngineArgs.from_kwargs(model, **kwargs)
        if args.kv_transfer_config is not None:
            raise ConfigError("kv_transfer_config needs a server: run `kvshard serve ... --kv-transfer-config` "
                              "and `kvshard proxy` (docs/disaggregation.md)")
        config = args.create_engine_config()
        self.engine = LLMEngine(config)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        atexit.register(self._finalizer)
        self._closed = False

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none, as vLLM's: kvshard's defaults, with the
        model's generation_config.json's temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens
        (as max_tokens) over them (`generation_config="vllm"` keeps kvshard's own)."""
        return SamplingParams(**self.config.generation.values)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings, token-id lists, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}`); outputs come back in prompt order."""
        if self._closed:
            raise RuntimeError("this LLM is closed (close() or the end of its `with` block): make a new one")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        # a list or any other sequence of them, one per prompt (vLLM takes any Sequence), else one for all
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple)) else
                  [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(p).__name__}")
        for prompt, p in zip(prompts, params):  # every error before anything runs
            p.validate()
            self.engine.validate_prompt(prompt, p)
        ids = [f"gen-{uuid.uuid4().hex[:12]}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.engine.add_request(request_id, prompt, p)
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm) as bar:
                while len(finished) < len(prompts):
                    for output in self.engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
            raise
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of `{"role", "content"}` messages) or to each of a list of
        them, as vLLM's `LLM.chat`: each is rendered with the chat template the server uses (`chat_template`, else
        the tokenizer's own, else a plain `role: content` one) and generated from as `generate` does; an output's
        `prompt` is the rendered conversation. `continue_final_message` (with add_generation_prompt False) leaves
        the last message open for the model to continue, as vLLM's."""
        from kvshard.entrypoints.openai.protocol import (APIError, ChatMessage, ChatTool, check_continue_final_message,
                                                         check_messages, validation_error_message)
        from kvshard.entrypoints.openai.serving_chat import chat_template_for
        from pydantic import ValidationError

        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat: call generate with token ids")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
        conversations = messages if all(isinstance(m, list) for m in messages) else [messages]
        tool_specs = None
        where: tuple = ()
        try:
            check_continue_final_message(continue_final_message, add_generation_prompt)
            if tools is not None:
                if not isinstance(tools, list):
                    raise ValueError(f"tools must be a list of tools, got {type(tools).__name__}")
                tool_specs = []
                for index, tool in enumerate(tools):
                    where = ("tools", index)
                    tool_specs.append(ChatTool.model_validate(tool).function.for_template())
                tool_specs = tool_specs or None
            rendered_conversations = []
            for number, conversation in enumerate(conversations):
                if not conversation:
                    raise ValueError("a conversation needs at least one message")
                parsed = []
                for index, message in enumerate(conversation):
                    where = ("messages", number, index) if len(conversations) > 1 else ("messages", index)
                    parsed.append(ChatMessage.model_validate(message))
                check_messages(parsed)
                rendered_conversations.append([message.for_template() for message in parsed])
        except APIError as error:
            raise ValueError(error.message) from None
        except ValidationError as error:  # one line naming the field: "tools.0.function: Field required"
            raise ValueError(validation_error_message(error, where)[0]) from None
        texts, prompts = [], []
        for conversation in rendered_conversations:
            template = chat_template_for(chat_template, tokenizer, conversation, tool_specs)
            text = tokenizer.apply_chat_template(conversation, tools=tool_specs, chat_template=template,
                                                 tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
            texts.append(text)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))  # the template wrote them
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (as vLLM's `LLM.reset_prefix_cache`); running requests keep their blocks."""
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_prompt_list(prompts) -> list[Prompt]:
    """One prompt or a list of them: a string, a list of token ids, or vLLM's {"prompt": text} /
    {"prompt_token_ids": ids}; anything else is a TypeError naming what came."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts)]
    if isinstance(prompts, SequenceABC) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return [_one_prompt(p) for p in prompts]
    raise TypeError(f"prompts must be a string, a list of token ids, or a list of those, got {type(prompts).__name__}")


def _one_prompt(prompt) -> Prompt:
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], SequenceABC):
            return list(prompt["prompt_token_ids"])
        raise TypeError(f"a prompt given as a dict must be {{'prompt': text}} or {{'prompt_token_ids': ids}}, "
                        f"got the keys {sorted(map(str, keys))}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
        return list(prompt)  # token ids: validate_prompt checks each
    raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
