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

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (as vLLM's `LLM.reset_prefix_cache`); running requests keep their blocks."""
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)
