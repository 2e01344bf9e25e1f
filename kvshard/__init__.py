"""kvshard: LLM inference and serving with Decode Context Parallelism."""

from kvshard.engine.process_setup import apply_openmp_defaults

apply_openmp_defaults()  # before torch loads its OpenMP runtime, which reads these settings once


from kvshard.config import ConfigError  # noqa: E402 (after the OpenMP settings)
from kvshard.entrypoints.llm import LLM
from kvshard.outputs import CompletionOutput, Logprob, RequestOutput
from kvshard.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "ConfigError", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
