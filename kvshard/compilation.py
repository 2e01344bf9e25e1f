"""The model step compiled: `torch.compile` (inductor) of the layers around attention, on the CPU.

What is compiled: the target model's `forward(input_ids, positions)` (embedding, every decoder layer's
norms, projections, RoPE, MLP and router, the residual adds) as one graph. What stays opaque, as custom
ops the graph calls (`torch.ops.kvshard.*`, below): attention (the DCP rhythm with its collectives, the
backend's kernels and the cache write: `attention`, and MLA's `mla_attention`, which also holds the
absorption and the chunk's expanded form), the routed experts of a MoE layer (`moe_experts`: they are
picked on the host), the TP all-reduce (`tp_all_reduce`: shared memory or gloo) and oneDNN's linear on
its reordered weight (`onednn_linear`, which inductor cannot lower from a runtime input) and the AMX
tiles' product of a bfloat16 weight (`amx_linear`, a call of the kernel extension). A part
reads what is not a tensor (metadata, caches, the ranks) from the forward context
(kvshard/forward_context.py) and is found there by its index; the logits (one product of the sampled
rows) and a proposer's draft passes stay eager.

The token count is dynamic: the graph is traced with the token dimension unbacked
(`torch._dynamo.decorators.mark_unbacked`), so one graph serves every step, one token or thousands
(no 0/1 specialisation); `CompiledModel.num_compiles` counts the graphs made (tests/test_compiled_step.py
checks it stays 1). Compilation happens at start-up (`warm_up`, the runner's dummy steps on a scratch
block) and its time is printed in the start-up report. Inductor's caches live in kvshard's cache
directory (`<KVSHARD_CACHE_DIR>/torch_compile`, or `TORCHINDUCTOR_CACHE_DIR` where set), so a restart
reuses the generated kernels and only traces again.

`--enforce-eager` or `-O 0` runs the model eagerly; batch-invariant mode always runs eagerly (its
row-tiled products are a dispatch mode the compiled graph would not see), and so do CUDA devices
(their decode steps are CUDA graphs: engine/cuda_graphs.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvshard import envs
from kvshard.forward_context import get_forward_context

if TYPE_CHECKING:
    from kvshard.config import EngineConfig

logger = logging.getLogger(__name__)

EAGER, COMPILED = 0, 3  # compilation levels, as vLLM numbers its modes (-O0: none, -O3: its compiled step)
COMPILATION_LEVELS = (EAGER, COMPILED)


# --- the opaque parts ---------------------------------------------------------------------------------

def opaque_parts(model: nn.Module) -> list[nn.Module]:
    """The model's parts that run outside the graph (a module with `opaque_forward`), numbered in order:
    each gets its `opaque_index`, the index the forward context's `opaque` list finds it by."""
    parts = [m for m in model.modules() if hasattr(m, "opaque_forward")]
    for index, part in enumerate(parts):
        part.opaque_index = index
    return parts


def call_opaque(op, part: nn.Module, *tensors: torch.Tensor, width: int) -> torch.Tensor:
    """`part.opaque_forward(*tensors)`; while torch.compile traces, the custom op `op` standing for it,
    whose fake result says the output's shape: [tokens, width] (the routed experts: tensors[0]'s shape)."""
    if torch.compiler.is_compiling():
        return op(*tensors, part.opaque_index, width)
    return part.opaque_forward(*tensors)


def _run_part(index: int, *tensors: torch.Tensor) -> torch.Tensor:
    # contiguous: the graph was compiled for the fake result's strides
    return get_forward_context().opaque[index].opaque_forward(*tensors).contiguous()


@torch.library.custom_op("kvshard::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int, width: int) -> torch.Tensor:
    """A GQA layer's attention: cache write, the DCP rhythm, this rank's output features [t, width]."""
    return _run_part(index, q, k, v)


@attention_op.register_fake
def _(q, k, v, index, width):
    return q.new_empty(q.shape[0], width)


@torch.library.custom_op("kvshard::mla_attention", mutates_args=())
def mla_attention_op(q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, index: int,
                     width: int) -> torch.Tensor:
    """An MLA layer's attention from its rotated query and latent parts: [t, width]."""
    return _run_part(index, q_nope, q_pe, c_kv, k_pe)


@mla_attention_op.register_fake
def _(q_nope, q_pe, c_kv, k_pe, index, width):
    return q_nope.new_empty(q_nope.shape[0], width)


@torch.library.custom_op("kvshard::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, index: int,
                   width: int) -> torch.Tensor:
    """This rank's routed experts' partial sum [t, D] (which experts run is decided on the host)."""
    return _run_part(index, x, topk_weights, topk_ids)


@moe_experts_op.register_fake
def _(x, topk_weights, topk_ids, index, width):
    return torch.empty_like(x)


@torch.library.custom_op("kvshard::tp_all_reduce", mutates_args=())
def tp_all_reduce_op(x: torch.Tensor) -> torch.Tensor:
    """The TP all-reduce of the forward context's ranks, into a new tensor (the same bits as in place)."""
    from kvshard.parallel import tp_all_reduce_into_new

    return tp_all_reduce_into_new(x, get_forward_context().parallel)


@tp_all_reduce_op.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("kvshard::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product with a weight reordered at load (layers/linear.py's, on its bucketed rows)."""
    from kvshard.layers.linear import onednn_product

    return onednn_product(x, packed_weight, bias)


@onednn_linear_op.register_fake
def _(x, packed_weight, bias):
    return x.new_empty(*x.shape[:-1], packed_weight.shape[0])


@torch.library.custom_op("kvshard::amx_linear", mutates_args=())
def amx_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of a weight marked for the AMX tiles (layers/linear.py's, on the tiles or torch's linear)."""
    from kvshard.layers.linear import amx_or_torch_product

    return amx_or_torch_product(x, weight, bias)


@amx_linear_op.register_fake
def _(x, weight, bias):
    from kvshard.layers.linear import weight_features

    return x.new_empty(*x.shape[:-1], weight_features(weight)[0])


# --- whether, and how -----------------------------------------------------------------------------------

def parse_compilation_level(value) -> int:
    """EngineArgs.compilation_config (`-O`): a level (0, 3, "3") or JSON `{"level": N}`; None takes
    $KVSHARD_COMPILATION_LEVEL (default EAGER: not yet shown faster, docs/serving.md). ConfigError for anything else."""
    from kvshard.errors import ConfigError

    given = value
    if value is None:
        value = envs.get("KVSHARD_COMPILATION_LEVEL")
        given = f"KVSHARD_COMPILATION_LEVEL={value}"
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if text.lstrip("-").isdigit() else json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(f"compilation_config={given!r} is neither a level nor JSON: give -O 0 or -O 3") from None
    if isinstance(value, dict):
        unknown = set(value) - {"level"}
        if unknown:
            raise ConfigError(f"compilation_config {given!r}: kvshard reads only \"level\", not {sorted(unknown)}")
        value = value.get("level", COMPILED)
    if isinstance(value, bool) or not isinstance(value, int) or value not in COMPILATION_LEVELS:
        raise ConfigError(f"compilation_config={given!r}: the levels are 0 (eager) and 3 (torch.compile of the "
                          "model step); vLLM's 1 and 2 have no kvshard counterpart")
    return value


def compile_unavailable(config: EngineConfig, device_type: str) -> str | None:
    """Why this engine's model step runs eagerly, or None where it is compiled."""
    if config.enforce_eager:
        return "--enforce-eager"
    if config.compilation_level == EAGER:
        return "-O 0"
    if device_type != "cpu":
        return "compiled on the CPU only (CUDA replays its decode steps as CUDA graphs)"
    if config.batch_invariant:
        return "--batch-invariant runs its row-tiled products eagerly"
    return None


def describe_compilation(config: EngineConfig, compile_seconds: float | None = None,
                         device_type: str | None = None) -> str:
    """The start-up report's line; with `compile_seconds`, what the warm-up took."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    why = compile_unavailable(config, device_type)
    if why is not None:
        return f"model step: eager ({why})"
    took = "" if compile_seconds is None else f", compiled in {compile_seconds:.1f} s at start-up"
    return (f"model step: compiled (torch.compile, inductor; attention, experts and collectives opaque; token count "
            f"dynamic{took}; cache {inductor_cache_dir()}; --enforce-eager turns it off)")


def inductor_cache_dir() -> str:
    """Where inductor keeps what it generated: $TORCHINDUCTOR_CACHE_DIR where the user set one, else
    <KVSHARD_CACHE_DIR>/torch_compile (inductor writes its own default, /tmp/torchinductor_USER, into the
    variable once it used it: that one does not count as set)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").strip()
    if given and os.path.abspath(given) != os.path.abspath(default_cache_dir()):
        return given
    return str(envs.cache_dir() / "torch_compile")


def _configure_inductor() -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()  # read by inductor at each use
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.compile_threads = 1  # no pool of compile workers: the ranks already share the cores


class CompiledModel:
    """`model.forward(input_ids, positions)` compiled once, for every token count.

    `num_compiles`: graphs inductor was asked for (1 after warm-up; a recompilation adds one)."""

    def __init__(self, model: nn.Module) -> None:
        _configure_inductor()
        self.model = model
        self.num_compiles = 0
        self.compile_seconds: float | None = None
        self._compiled = torch.compile(model, backend=self._backend, fullgraph=True, dynamic=False)

    def _backend(self, graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        self.num_compiles += 1
        return compile_fx(graph, example_inputs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        return self._compiled(input_ids, positions)

    def warm_up(self, step: Callable[[Callable], None]) -> float:
        """Compile now: `step(self)` runs dummy steps through it. Returns (and keeps) the seconds taken."""
        start = time.perf_counter()
        step(self)
        self.compile_seconds = time.perf_counter() - start
        logger.info("model step compiled in %.1f s (%d graph(s))", self.compile_seconds, self.num_compiles)
        return self.compile_seconds
