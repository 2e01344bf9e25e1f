"""kvshard: LLM inference and serving with Decode Context Parallelism."""

from kvshard.config import ConfigError
from kvshard.entrypoints.llm import LLM
from kvshard.outputs import CompletionOutput, RequestOutput
from kvshard.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "ConfigError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
