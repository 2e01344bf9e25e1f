"""`EngineArgs`: every engine setting, defined once with its flag, default, help and check.

The CLI (`serve`, `generate`, `bench`) adds the settings to its parser with
`EngineArgs.add_cli_args`, reads them back with `EngineArgs.from_cli_args`;
`LLM(model, **kwargs)` takes the same names through `EngineArgs.from_kwargs`.
`create_engine_config` validates everything and builds the `EngineConfig`
before any process starts. A new setting is one field here (plus where it is used).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvshard import envs
from kvshard.attention.backends import ATTENTION_BACKENDS, resolve_backend_name
from kvshard.compilation import parse_compilation_level
from kvshard.config import (
    ATTENTION_LAYOUTS,
    DCP_COMM_BACKENDS,
    REPLICATED,
    CacheConfig,
    ConfigError,
    LPM,
    SCHEDULING_POLICIES,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    choose_attention_layout,
    load_model_config,
    parse_memory_size,
)
from kvshard.config.generation import (AUTO_LENGTH, cli_length, load_generation_defaults, model_context_length,
                                      parse_length)
from kvshard.kv.cache import resolve_kv_cache_dtype
from kvshard.models.demo import DEFAULT_DEMO_MODEL
from kvshard.sampling_params import INT64_MAX, INT64_MIN
from kvshard.spec_decode.config import check_mtp_checkpoint, parse_speculative_config

# Tokens per step by default (decodes first, then prompt chunks): vLLM's OpenAI server default on a CPU. On the
# trace workload (mostly prefill), 2,048 against 512 halved TTFT p50 and gave as many output tokens per
# second or more (BENCHMARKS.md, "The prefill chunk on the trace").
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _setting(default: Any, help: str, *aliases: str, cli_type: type | None = None, positive: bool = False,
             choices: tuple[str, ...] | None = None, switches: dict[str, Any] | None = None) -> Any:
    """A dataclass field that also says how it looks on the command line.

    The flag is the field name in kebab case; `aliases` are further spellings (a `--long`
    alias is also accepted as a keyword of `LLM`); `cli_type` parses the flag (default: the
    type of `default`); `positive` values must be integers >= 1 (None means "derived");
    `choices` are the values allowed; `switches` are flags without a value that set one
    (`--dcp-replicate-q` sets "replicated"), also keywords of `LLM` taking True.
    """
    return field(default=default, metadata={"help": help, "aliases": aliases,
                                            "type": cli_type or (str if default is None else type(default)),
                                            "positive": positive, "choices": choices, "switches": switches or {}})


@dataclass
class EngineArgs:
    model: str = _setting(DEFAULT_DEMO_MODEL, "checkpoint directory or built-in demo model")
    tensor_parallel_size: int = _setting(1, "ranks (processes) in all; DCP reuses them", "-tp", positive=True)
    decode_context_parallel_size: int = _setting(
        1, "ranks per DCP group (KV sharded along the sequence)", "--dcp", "-dcp", positive=True)
    dcp_kv_interleave_size: int | None = _setting(
        None, "consecutive tokens per rank (default: $KVSHARD_DCP_KV_INTERLEAVE_SIZE, "
              "$VLLM_DCP_KV_INTERLEAVE_SIZE, or 1)", cli_type=int, positive=True)
    dcp_attention_layout: str = _setting(
        "auto", "head-split: query heads split over all ranks, all-gathered in each DCP group; replicated: every "
                "rank computes its group's queries (dcp x the query projection weights, one collective fewer per "
                "layer, and any head count that tp/dcp divides); auto: head-split where it applies",
        choices=ATTENTION_LAYOUTS, switches={"--dcp-replicate-q": REPLICATED})
    dcp_comm_backend: str = _setting(
        "auto", "how a DCP group merges its partial attentions: ag_rs (LSE all-gather + reduce-scatter, or one "
                "all-gather of [output|lse] for small outputs), a2a (one all-to-all of each rank's share of "
                "[output|lse], merged locally), auto: chosen per layer by message size",
        choices=DCP_COMM_BACKENDS)
    enable_expert_parallel: bool = _setting(
        False, "a MoE model's routed experts: whole experts on each rank (tp must divide their count); by default "
               "every expert is split over the ranks by its intermediate dimension, so each rank does an equal "
               "share of every token's expert work (vLLM's flag and default)")
    attention_backend: str = _setting(
        "auto", "what attends to the paged KV cache: paged (a C++ kernel reading the blocks in place; CPU, built "
                "once per machine on first use), gather (the blocks copied out, then PyTorch's flash kernel), "
                "reference (plain matmuls, the test oracle); auto: paged where the kernel builds, else gather",
        choices=ATTENTION_BACKENDS)
    block_size: int = _setting(16, "tokens per physical block; a virtual block holds block_size * dcp",
                               positive=True)
    kv_cache_memory: str | int = _setting("1GiB", "KV budget per rank, e.g. 64MiB or 2GiB")
    num_kv_blocks: int | None = _setting(None, "KV blocks per rank (overrides --kv-cache-memory)", cli_type=int,
                                         positive=True)
    max_model_len: int | str | None = _setting(
        None, "longest prompt + completion: tokens, 32k (32,000) or 32K (32,768), or auto (-1: the longest the KV "
              "cache holds); default: the model's max_position_embeddings, times the RoPE scaling factor for linear "
              "and yarn (yarn's over original_max_position_embeddings)", cli_type=cli_length)
    max_num_seqs: int = _setting(64, "sequences in the running batch at most", positive=True)
    max_num_batched_tokens: int | None = _setting(
        None, "tokens per step at most (default: max(2048, max-num-seqs), vLLM's server default on a CPU)",
        cli_type=int, positive=True)
    dtype: str = _setting("auto", "auto, float32, bfloat16 or float16")
    kv_cache_dtype: str = _setting(
        "auto", "what the KV cache stores: auto (the model's dtype) or fp8 (= fp8_e4m3: float8 e4m3, half the "
                "bytes of bfloat16; per-layer k_scale/v_scale from the checkpoint, else 1.0)")
    seed: int = _setting(0, "seed of requests that give none")
    generation_config: str = _setting(
        "auto", "sampling defaults of requests that leave them out: auto (the model's generation_config.json: "
                "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm (kvshard's own), or a "
                "folder holding a generation_config.json")
    override_generation_config: str | dict | None = _setting(
        None, 'sampling defaults over the generation config, JSON: \'{"temperature": 0.5}\'', cli_type=str)
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of a shared prompt prefix")
    scheduling_policy: str = _setting(
        "fcfs", "the order waiting requests are admitted in: fcfs (arrival) or lpm (longest cached prefix first, "
                "ties by arrival: agentic sessions find their previous turn still cached; a request with no "
                "cached prefix may wait longer under load)", choices=SCHEDULING_POLICIES)
    speculative_config: str | dict | None = _setting(
        None, 'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'', cli_type=str)
    kv_transfer_config: str | None = _setting(
        None, "disaggregated prefill/decode, JSON: '{\"kv_role\": \"kv_producer\"}' or \"kv_consumer\" "
              "(serve only; see docs/disaggregation.md)")
    batch_invariant: bool = _setting(
        False, "deterministic mode: a request's tokens and logprobs do not depend on the batch it runs in, "
               "at a cost in throughput; turns prefix caching off (docs/serving.md)")

    enforce_eager: bool = _setting(
        False, "run the model eagerly: on a CPU no torch.compile of the model step (the same as -O 0), on CUDA "
               "no CUDA graphs (captured at start-up for batches of 1, 2, 4, ... max-num-seqs)")
    compilation_config: str | int | dict | None = _setting(
        None, "the model step on a CPU: 0 runs it eagerly, 3 compiles it with torch.compile (inductor) at start-up, "
              "attention, experts and collectives left opaque (as vLLM's -O levels; or JSON {\"level\": N}); "
              "default: $KVSHARD_COMPILATION_LEVEL, else 0", "-O", cli_type=str)

    # vLLM's flags that command lines written for it carry: taken where they ask for what kvshard does (or for
    # nothing that changes what it does: a start-up note says so), refused in one line where they ask for more
    trust_remote_code: bool = _setting(
        False, "accepted: kvshard never runs a checkpoint's code, it reads the supported architectures itself")
    tokenizer: str | None = _setting(None, "the tokenizer's directory: only the model's own (kvshard reads it there)")
    revision: str | None = _setting(None, "not taken: kvshard never downloads; pass the local checkpoint directory")
    download_dir: str | None = _setting(None, "accepted, unused: kvshard never downloads")
    load_format: str = _setting("auto", "auto, safetensors or pt: kvshard reads *.safetensors, else "
                                        "pytorch_model*.bin (and .gguf files given as the model)")
    quantization: str | None = _setting(
        None, "the checkpoint's own quantization (fp8 for block-scaled FP8 checkpoints); kvshard does not quantize "
              "a checkpoint as it loads it", "-q")
    gpu_memory_utilization: float | None = _setting(
        None, "not taken: kvshard's KV budget is --kv-cache-memory (per rank) or --num-kv-blocks", cli_type=float)
    swap_space: float | None = _setting(
        None, "accepted, unused: kvshard preempts by recomputing, it swaps nothing to the host", cli_type=float)
    pipeline_parallel_size: int = _setting(1, "1 only: kvshard splits a model by tensor and decode context "
                                              "parallelism", "-pp", positive=True)
    data_parallel_size: int = _setting(1, "1 only: run one server per replica behind a load balancer", "-dp",
                                       positive=True)
    distributed_executor_backend: str | None = _setting(
        None, "mp (kvshard's: one process per rank, spawned; torchrun across machines) or uni at tp=1")
    enable_chunked_prefill: bool | None = _setting(
        None, "kvshard always takes long prompts in chunks of --max-num-batched-tokens", cli_type=bool)
    max_logprobs: int = _setting(20, "log-probabilities per token at most: 20 (OpenAI's limit)")
    disable_log_stats: bool = _setting(False, "accepted: kvshard logs no periodic statistics (see /metrics)")

    def __post_init__(self) -> None:
        """What argparse checks on the command line, checked for the Python API too (`LLM(...)`)."""
        self.check_choices()

    def check_choices(self) -> None:
        """Every setting with `choices` holds one of them: ConfigError (a ValueError) naming the field."""
        for f in fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"{f.name}={value!r} is not one of {', '.join(choices)}")

    # --- command line -------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                     exclude: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add every setting as a flag (MODEL positional); `defaults` overrides some defaults."""
        defaults = defaults or {}
        unknown = (set(defaults) | set(exclude)) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"not engine settings: {sorted(unknown)}")
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if f.name in exclude:
                continue
            default = defaults.get(f.name, f.default)
            shown = "" if default is None else " (default: %(default)s)"
            help_text = f.metadata["help"].replace("%", "%%") + shown
            if f.name == "model":
                group.add_argument("model", nargs="?", default=default, help=help_text)
            elif f.metadata["choices"]:
                group.add_argument(_flag(f.name), *f.metadata["aliases"], dest=f.name, default=default,
                                   choices=f.metadata["choices"], help=help_text)
            elif f.metadata["type"] is bool:
                group.add_argument(_flag(f.name), *f.metadata["aliases"], dest=f.name, default=default,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            else:
                group.add_argument(_flag(f.name), *f.metadata["aliases"], dest=f.name, default=default,
                                   type=f.metadata["type"], help=help_text)
            for switch, value in f.metadata["switches"].items():
                group.add_argument(switch, dest=f.name, action="store_const", const=value,
                                   help=f"the same as {_flag(f.name)} {value}")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_cli_args(self, exclude: tuple[str, ...] = ()) -> list[str]:
        """The flags that give these settings (those left at their defaults are omitted), for a child `serve`."""
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "model" or f.name in exclude or value == f.default:
                continue
            if f.metadata["type"] is bool:
                argv.append(_flag(f.name) if value else _flag(f.name).replace("--", "--no-", 1))
            else:
                argv += [_flag(f.name), json.dumps(value) if isinstance(value, dict) else str(value)]
        return argv

    # --- Python API ---------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, model: str = DEFAULT_DEMO_MODEL, **kwargs: Any) -> "EngineArgs":
        """`LLM(model, **kwargs)`: field names or their long aliases (`dcp=2`); a typo names close matches."""
        names: dict[str, str] = {}
        switches: dict[str, tuple[str, Any]] = {}  # keyword -> (field, the value True sets)
        for f in fields(cls):
            names[f.name] = f.name
            for alias in f.metadata["aliases"]:
                if alias.startswith("--"):
                    names[alias[2:].replace("-", "_")] = f.name
            for switch, set_value in f.metadata["switches"].items():
                switches[switch[2:].replace("-", "_")] = (f.name, set_value)
        settings: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in switches:
                if not value:  # False leaves the setting to its own keyword or default
                    continue
                key, value = switches[key][0], switches[key][1]
            if key not in names:
                close = difflib.get_close_matches(key, [*names, *switches], n=3)
                hint = f"; did you mean {' or '.join(close)}?" if close else ""
                raise TypeError(f"{key!r} is not an engine setting{hint} (see kvshard.engine.arg_utils.EngineArgs)")
            name = names[key]
            if name in settings and settings[name] != value:
                raise ConfigError(f"{key}={value!r} and {name}={settings[name]!r} set the same thing: give one")
            settings[name] = value
        return cls(model=model, **settings)

    # --- validation -----------------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """Check every setting against the model and build the config; raises ConfigError saying what to change."""
        self.check_choices()  # again: a field may have been assigned since __init__
        for f in fields(self):
            value = getattr(self, f.name)
            kind = f.metadata.get("type")
            if value is None and f.default is not None:  # only the settings whose default is None may be None
                raise ConfigError(f"{f.name} needs a value (default {f.default!r}), got None")
            if f.metadata["positive"] and value is not None:
                _check_positive(f.name, value)
            elif kind is bool and value is not None and not isinstance(value, bool):  # "no" would read as True
                raise ConfigError(f"{f.name}={value!r} must be True or False")
            elif kind is int and value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(f"{f.name}={value!r} must be an integer")
        if not INT64_MIN <= self.seed <= INT64_MAX:  # it seeds torch generators, as a request's seed does
            raise ConfigError(f"seed must be an integer in [{INT64_MIN}, {INT64_MAX}], got {self.seed}")
        speculative = parse_speculative_config(self.speculative_config)
        model_config = load_model_config(self.model, self.dtype)
        notes = self._check_foreign_settings(model_config)
        generation = load_generation_defaults(model_config.path, self.generation_config,
                                              self.override_generation_config)
        interleave = _resolve_interleave(self.dcp_kv_interleave_size)
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        layout = choose_attention_layout(model_config, tp, dcp, self.dcp_attention_layout, self.enable_expert_parallel)
        parallel = ParallelConfig(tp, dcp, interleave, layout, self.dcp_comm_backend, self.enable_expert_parallel)
        attention_backend = resolve_backend_name(self.attention_backend)  # auto builds the kernel here, once
        if speculative is not None and speculative.method == "draft_model":
            speculative = _with_draft_model(speculative, model_config, parallel, self.dtype)
        mtp = speculative is not None and speculative.method == "mtp"
        if mtp:
            check_mtp_checkpoint(model_config)
        if self.block_size % interleave != 0:
            raise ConfigError(
                f"block_size={self.block_size} is not a multiple of dcp_kv_interleave_size={interleave}: "
                f"choose an interleave size that divides the block size (1 or {self.block_size}, say)"
            )
        window = model_config.sliding_window
        context = model_context_length(model_config)
        longest, why = context.tokens, context.why
        if window is not None and window < longest:
            longest, why = window, f"the sliding window of {window:,} tokens (kvshard does not implement one)"
        max_model_len = parse_length(self.max_model_len) if self.max_model_len is not None else None
        if max_model_len is None:
            max_model_len, source = longest, f"the model's, {why}"
        elif max_model_len == AUTO_LENGTH:
            source = "auto"
        elif max_model_len < 1:
            raise ConfigError(f"max_model_len must be a positive number of tokens or auto, got {self.max_model_len!r}")
        elif max_model_len > longest:
            limit = (f"max_position_embeddings={longest}" if why == f"max_position_embeddings {longest:,}" else
                     f"context length of {longest:,} tokens ({why})")
            raise ConfigError(f"max_model_len={max_model_len} exceeds the model's {limit}: lower --max-model-len")
        else:
            source = "--max-model-len"
        # a prefix hit computes the rest of the prompt against cached context: other bits than without it;
        # an MTP cache entry depends on the token after it, which a block's hash does not cover
        cache = CacheConfig(self.block_size, parse_memory_size(self.kv_cache_memory), self.num_kv_blocks,
                            self.enable_prefix_caching and not self.batch_invariant and not mtp, self.kv_cache_dtype)
        resolve_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype)  # an unknown name fails here, early
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)
        if max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} is below max_num_seqs={self.max_num_seqs}: "
                "every running request needs one token per decode step"
            )
        if self.scheduling_policy == LPM and not cache.enable_prefix_caching:
            off = ("--batch-invariant turns it off" if self.batch_invariant else
                   "MTP speculation turns it off" if mtp else "--no-enable-prefix-caching")
            raise ConfigError(f"--scheduling-policy lpm orders requests by their cached prefix, but prefix caching "
                              f"is off ({off}): use --scheduling-policy fcfs")
        if max_model_len == AUTO_LENGTH:  # as long as the model allows and one request's KV fits
            probe = EngineConfig(model_config, parallel, cache,
                                 SchedulerConfig(self.max_num_seqs, max_num_batched_tokens, longest), self.seed,
                                 speculative=speculative)
            max_model_len = min(longest, probe.kv_capacity_tokens)
            source = (f"auto: the model's {longest:,} ({why})" if max_model_len == longest else
                      f"auto: as many tokens as the KV cache holds; the model's is {longest:,}")
        scheduler = SchedulerConfig(self.max_num_seqs, max_num_batched_tokens, max_model_len, self.scheduling_policy)
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError(f"enforce_eager={self.enforce_eager!r} must be True or False")
        compilation_level = parse_compilation_level(self.compilation_config)
        config = EngineConfig(model_config, parallel, cache, scheduler, self.seed, self.batch_invariant, speculative,
                              attention_backend, enforce_eager=self.enforce_eager,
                              compilation_level=compilation_level, generation=generation,
                              max_model_len_source=source, notes=tuple(notes))
        if config.kv_capacity_tokens < max_model_len:
            raise ConfigError(
                f"the KV cache holds {config.kv_capacity_tokens:,} tokens ({config.num_kv_blocks} blocks per rank), "
                f"fewer than one request of max_model_len={max_model_len}: raise --kv-cache-memory, "
                "raise --dcp, or lower --max-model-len"
            )
        return config

    def _check_foreign_settings(self, model_config) -> list[str]:
        """vLLM's settings kvshard takes only as far as they ask for what it does: a ConfigError saying what kvshard
        offers instead for the others; a start-up note for each one given that changes nothing kvshard does."""
        notes = []

        def refuse(flag: str, message: str) -> None:
            raise ConfigError(f"--{flag} {message}")

        if self.gpu_memory_utilization is not None:
            refuse("gpu-memory-utilization", "is not taken: kvshard does not size the KV cache from a share of the "
                   "device's memory; give the KV budget per rank with --kv-cache-memory (e.g. 20GiB) or "
                   "--num-kv-blocks, and --max-model-len auto to fit the context length to it")
        if self.pipeline_parallel_size != 1:
            refuse("pipeline-parallel-size", f"{self.pipeline_parallel_size}: kvshard has no pipeline parallelism; "
                   "split the model with --tensor-parallel-size (and --decode-context-parallel-size for the KV "
                   "cache), across machines under torchrun")
        if self.data_parallel_size != 1:
            refuse("data-parallel-size", f"{self.data_parallel_size}: kvshard serves one replica per server; start "
                   "one `kvshard serve` per replica behind a load balancer")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "uni"):
            refuse("distributed-executor-backend", f"{backend!r} is not taken: kvshard starts its ranks itself "
                   "(mp: one process each, spawned) or under torchrun across machines (docs/serving.md)")
        if backend == "uni" and self.tensor_parallel_size > 1:
            refuse("distributed-executor-backend", f"uni runs one rank, but --tensor-parallel-size is "
                   f"{self.tensor_parallel_size}: use mp (kvshard's, the default)")
        if backend is not None:
            notes.append(f"--distributed-executor-backend {backend}: kvshard's own (one process per rank)")
        if self.enable_chunked_prefill is False:
            refuse("no-enable-chunked-prefill", "is not taken: kvshard always takes long prompts in chunks of "
                   "--max-num-batched-tokens; raise --max-num-batched-tokens to --max-model-len to take every "
                   "prompt whole")
        if self.max_logprobs != 20:
            refuse("max-logprobs", f"{self.max_logprobs}: kvshard returns at most 20 log-probabilities per token "
                   "(OpenAI's limit), for every request; leave --max-logprobs out (or 20)")
        if self.revision is not None:
            refuse("revision", f"{self.revision!r} is not taken: kvshard never downloads a model; pass the local "
                   "directory of the revision you want as MODEL")
        if self.tokenizer is not None:
            from kvshard.config.model_dir import resolve_model_path

            try:
                same = resolve_model_path(self.tokenizer) == model_config.path
            except ConfigError:
                same = False
            if not same:
                refuse("tokenizer", f"{self.tokenizer!r} is not taken: kvshard reads the tokenizer from the model "
                       f"directory ({model_config.path}); put the tokenizer files there, or leave --tokenizer out")
        if self.load_format not in ("auto", "safetensors", "pt"):
            refuse("load-format", f"{self.load_format!r} is not taken: kvshard loads *.safetensors, else "
                   "pytorch_model*.bin (auto, safetensors, pt), and .gguf files given as MODEL"
                   + ("; it makes no random weights (the built-in demo models have them)"
                      if self.load_format == "dummy" else ""))
        if self.load_format != "auto":
            from kvshard.models.loader import checkpoint_files

            suffix = ".safetensors" if self.load_format == "safetensors" else ".bin"
            files = checkpoint_files(model_config.path)
            if not all(str(f).endswith(suffix) for f in files):
                refuse("load-format", f"{self.load_format}: the checkpoint's weights kvshard reads are "
                       f"{', '.join(sorted({Path(f).suffix for f in files}))} files; use auto")
        if self.quantization is not None:
            own = "fp8" if model_config.quantization is not None else None
            if self.quantization != own:
                has = (f"its checkpoint is {own}-quantized, which kvshard reads without the flag" if own else
                       "the checkpoint is not quantized, and kvshard does not quantize one as it loads it")
                refuse("quantization", f"{self.quantization!r} is not taken: {has}; leave --quantization out")
            notes.append("--quantization fp8: the checkpoint's own block-scaled FP8 weights")
        if self.trust_remote_code:
            notes.append("--trust-remote-code: kvshard runs no checkpoint code, it reads the supported "
                         "architectures itself")
        if self.download_dir is not None:
            notes.append(f"--download-dir {self.download_dir}: unused, kvshard never downloads")
        if self.swap_space is not None:
            notes.append(f"--swap-space {self.swap_space:g}: unused, kvshard preempts by recomputing, it swaps "
                         "nothing to the host")
        if self.enable_chunked_prefill:
            notes.append("--enable-chunked-prefill: always on in kvshard (chunks of --max-num-batched-tokens)")
        if self.disable_log_stats:
            notes.append("--disable-log-stats: kvshard logs no periodic statistics (/metrics has them)")
        return notes


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def _resolve_interleave(flag_value: int | None) -> int:
    """The flag wins; then $KVSHARD_DCP_KV_INTERLEAVE_SIZE, then $VLLM_DCP_KV_INTERLEAVE_SIZE (for existing
    recipes: kvshard/envs.py); default 1."""
    if flag_value is not None:
        return flag_value
    from_env = envs.get("KVSHARD_DCP_KV_INTERLEAVE_SIZE")
    return 1 if from_env is None else from_env


def _with_draft_model(speculative, target: ModelConfig, parallel: ParallelConfig, dtype: str):
    """Load the draft checkpoint's config and check it against the target and its attention layout."""
    draft = load_model_config(speculative.model, dtype)
    if draft.hf_config.vocab_size != target.hf_config.vocab_size:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.hf_config.vocab_size} tokens) differs from the target's "
            f"({target.hf_config.vocab_size}): a draft model must share the target's tokenizer"
        )
    tp, dcp = parallel.tensor_parallel_size, parallel.decode_context_parallel_size
    try:
        layout = choose_attention_layout(draft, tp, dcp, parallel.attention_layout, parallel.enable_expert_parallel)
    except ConfigError as error:
        raise ConfigError(f"draft model {speculative.model}: {error}") from None
    if layout != parallel.attention_layout:
        raise ConfigError(f"draft model {speculative.model} runs attention {layout} at tp={tp} dcp={dcp}, the "
                          f"target {parallel.attention_layout}: choose a draft whose heads split as the target's")
    return dataclasses.replace(speculative, draft_model_config=draft)
