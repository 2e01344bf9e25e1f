"""A Llama-family decode step's layers as one flat program of the kernel extension's calls (CPU, one rank).

On a CPU a decode step of a small model spends much of its host time between its kernels: each layer's modules,
the attention's DCP rhythm (with one rank, every collective an identity), the checks of each operator's fast path,
the views and conversions around them. Measured against the same calls made straight in a row, the layers' Python
cost some 120 us a layer (the GQA demo's four layers in bfloat16: 1.56 against 1.08 ms a step at 32 requests), 7-10
ms of SmolLM2's 30-layer step at 32 x 1,024 tokens (BENCHMARKS.md section 39).

`DecodeProgram` binds, once, every layer's weights and the extension's functions, and runs a step that is all
context rows (decodes, speculative verification rows: no prefill chunk) as that row of calls: the residual add and
RMSNorm, the QKV product, the rotary embedding, the cache write, the paged kernel, the output's conversion, the
output product, the residual add and RMSNorm, the MLP's products around SiLU-and-multiply. They are the calls the
modules make for such a step, in the same order on the same tensors, so the states are the same bits
(tests/test_decode_program.py holds the two against each other); the modules stay the oracle and run every other
step (a prefill chunk, more rows than the AMX products take, the batch-invariant mode). Where every product takes the
AMX tiles, the whole row of calls is one call of the extension (`decode_layers`): from Python, the first operator
after each long kernel call paid for the interpreter's code and data that the kernel's stream had evicted from the
core's caches (40 us where it takes 2-4).

Where it runs (`program_unavailable` says why not): a CPU, one rank (the layers' collectives live in their modules),
a Llama-family model (MLA's attention runs its own modules), float32 or bfloat16 without FP8 weights or an FP8 KV
cache, the kernel extension's fused operators on and built with AVX-512, the paged attention backend, the model step
eager (a compiled step has its own graph), outside the batch-invariant mode; --enforce-eager (as it turns CUDA graphs
off) and KVSHARD_DECODE_PROGRAM=0 keep the modules for every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvshard import envs
from kvshard.attention import fused_ops, paged
from kvshard.attention.backends import PAGED, PagedBackend, resolve_backend_name
from kvshard.forward_context import get_forward_context
from kvshard.layers.batch_invariant import batch_invariant_active
from kvshard.layers.linear import AMX_LINEAR_ALWAYS, LinearBase

if TYPE_CHECKING:
    from kvshard.config import EngineConfig

Product = Callable[[torch.Tensor], torch.Tensor]


class _Layer(NamedTuple):
    """One layer as the program calls it, bound once."""

    norm_in: torch.nn.Module  # RMSNorm before the attention, and after it
    norm_post: torch.nn.Module
    qkv: Product  # x -> the layer's forward of each product (bias included)
    o: Product
    gate_up: Product
    down: Product
    q_end: int  # where q and k end among the QKV product's features
    k_end: int
    hq: int  # query heads, KV heads, head size
    hk: int
    d: int
    qk_norm: tuple | None  # Qwen3's per-head norms of q and k
    index: int  # its cache among the forward context's
    scale: float


def program_unavailable(config: EngineConfig, device_type: str) -> str | None:
    """Why this engine's decode steps run the layers' modules, or None where they run as a `DecodeProgram`."""
    from kvshard.compilation import compile_unavailable
    from kvshard.models.llama import LlamaForCausalLM
    from kvshard.models.registry import model_class

    if config.enforce_eager:  # as it turns CUDA graphs off: the layers' modules, plainly
        return "--enforce-eager"
    if not envs.get("KVSHARD_DECODE_PROGRAM"):
        return "KVSHARD_DECODE_PROGRAM=0"
    if device_type != "cpu":
        return "the flat program is the CPU's"
    if config.parallel.world_size > 1:
        return "the flat program runs one rank's steps; with more, the layers' collectives run in their modules"
    if config.model.is_mla or not issubclass(model_class(config.model.architecture), LlamaForCausalLM):
        return "the flat program runs Llama-family layers; this model's run in their modules"
    if config.model.quantization is not None:
        return "FP8 weights multiply in their layers' modules"
    if config.model.dtype not in fused_ops.FUSED_DTYPES:
        return "the flat program runs float32 and bfloat16 models"
    if config.kv_cache_dtype != config.model.dtype:
        return "an FP8 KV cache is written by PyTorch's path"
    if compile_unavailable(config, device_type) is None:
        return "the model step is compiled"
    if config.batch_invariant:
        return "--batch-invariant runs its steps in the modules"
    if resolve_backend_name(config.attention_backend, device_type) != PAGED:
        return "the flat program calls the paged attention kernel"
    ops = fused_ops.cpu_ops()
    if ops is None or not ops.tiled:
        return "the flat program calls the kernel extension's fused operators, built with AVX-512"
    return None


def describe_decode_program(config: EngineConfig) -> str:
    """The start-up report's line on a CPU."""
    why = program_unavailable(config, "cpu")
    if why is not None:
        return f"decode steps: eager, in the layers' modules ({why})"
    return ("decode steps: eager; steps of context rows alone (decodes, speculative verification rows) run as one "
            "flat program of the kernel extension's calls, the same bits as the layers' modules "
            "(--enforce-eager or KVSHARD_DECODE_PROGRAM=0 keeps the modules)")


class DecodeProgram:
    """The model's forward (`model(input_ids, positions)` -> states [t, D] before the final norm) for the steps it
    `takes`, the layers' modules (`fallback`) for the others."""

    def __init__(self, model, fallback: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        ext = paged.load_extension()
        self.model = model
        self.fallback = fallback
        self.amx_tiles = paged.amx_ready()
        self.max_rows = AMX_LINEAR_ALWAYS  # the AMX products' rows (more run torch's linear in the modules)
        self._ext = ext
        self._layers = [self._bind(layer, ext) for layer in model.model.layers]
        self.native = self._native_arguments(model)  # the extension's `decode_layers`, where it takes the layers

    @staticmethod
    def _native_arguments(model) -> tuple | None:
        """What the extension's `decode_layers` needs besides the step's tensors, where every product of every layer
        takes the AMX tiles and the layers share their norms' eps, their heads and their attention's scale (one call
        runs them all, with no return to Python between the calls: see its comment); else None."""
        weights, shapes = [], set()
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            products = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(p.amx_weight for p in products):
                return None
            norms = (layer.input_layernorm, layer.post_attention_layernorm) + (
                (attn.q_norm, attn.k_norm) if attn.qk_norm else ())
            qkv = attn.qkv_proj
            shapes.add((qkv.num_heads, qkv.num_kv_heads, qkv.head_dim, attn.attn.scale, *(n.eps for n in norms)))
            weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                        qkv.weight, qkv.bias, attn.o_proj.weight, attn.o_proj.bias,
                        mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias,
                        attn.q_norm.weight if attn.qk_norm else None, attn.k_norm.weight if attn.qk_norm else None]
        if len(shapes) != 1 or len(set(next(iter(shapes))[4:])) != 1:
            return None
        hq, hk, d, scale, eps = next(iter(shapes))[:5]
        return weights, hq, hk, d, scale, eps

    @staticmethod
    def _bind(layer, ext) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        hq, hk, d = qkv.num_heads, qkv.num_kv_heads, qkv.head_dim
        return _Layer(layer.input_layernorm, layer.post_attention_layernorm, _product(ext, qkv, qkv.bias),
                      _row_product(ext, attn.o_proj), _product(ext, mlp.gate_up_proj, mlp.gate_up_proj.bias),
                      _row_product(ext, mlp.down_proj), hq * d, (hq + hk) * d, hq, hk, d,
                      (attn.q_norm, attn.k_norm) if attn.qk_norm else None, attn.layer_index, attn.attn.scale)

    def takes(self, meta, rows: int) -> bool:
        """Whether a step of `rows` tokens with this metadata runs as the program: context rows alone, each written
        to the cache, on the paged kernel, within the AMX products' rows, outside the batch-invariant mode."""
        return (type(meta.backend) is PagedBackend and meta.writes_every_token and not meta.has_prefill
                and meta.uses_context and meta.context_rows == rows and 0 < rows <= self.max_rows
                and not batch_invariant_active())

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        meta = context.meta
        if not self.takes(meta, input_ids.shape[0]):
            return self.fallback(input_ids, positions)
        return self.run(input_ids, positions, meta, context.caches)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, caches) -> torch.Tensor:
        ext, model = self._ext, self.model
        cos, sin = model.rotary.cos_sin(positions)
        x = model.model.embed_tokens(input_ids)  # [t, D]
        t = x.shape[0]
        slots, tables, seqs, lens = meta.write_slots, meta.block_tables, meta.row_seq, meta.row_lens
        if self.native is not None:  # every layer in one call of the extension
            weights, hq, hk, d, scale, eps = self.native
            layers = [caches[layer.index] for layer in self._layers]
            return ext.decode_layers(x, cos, sin, weights, [c.key for c in layers], [c.value for c in layers], slots,
                                     tables, seqs, lens, layers[0].block_size, scale, hq, hk, d, eps, self.amx_tiles)
        residual = None
        for layer in self._layers:
            if residual is None:  # the first layer: its input is the residual stream
                h, residual = layer.norm_in(x), x
            else:
                h, residual = ext.add_rms_norm(x, residual, layer.norm_in.weight, layer.norm_in.eps)
            qkv = layer.qkv(h)  # [t, (hq + 2 hk) d]
            hq, hk, d = layer.hq, layer.hk, layer.d
            q = qkv[:, :layer.q_end].view(t, hq, d)
            k = qkv[:, layer.q_end:layer.k_end].view(t, hk, d)
            v = qkv[:, layer.k_end:].view(t, hk, d)
            if layer.qk_norm is not None:
                q, k = layer.qk_norm[0](q), layer.qk_norm[1](k)
            q, k = ext.rotary(q, cos, sin, False), ext.rotary(k, cos, sin, False)
            cache = caches[layer.index]
            ext.write_kv(cache.key, cache.value, slots, k, v)
            packed = ext.paged_attention(q, cache.key, cache.value, tables, seqs, lens, cache.block_size, layer.scale,
                                         1.0, 1.0, 0, False, True, self.amx_tiles)  # [t, hq, d + 1]: [o | lse]
            o = ext.flatten_heads(packed[..., :-1], q.dtype == torch.bfloat16)  # [t, hq d]
            h, residual = ext.add_rms_norm(layer.o(o), residual, layer.norm_post.weight, layer.norm_post.eps)
            x = layer.down(ext.silu_and_mul(layer.gate_up(h)))
        return x + residual


def _product(ext, layer: LinearBase, bias: torch.Tensor | None) -> Product:
    """x @ weight.T (+ bias) as the layer computes it: on the AMX tiles where it marked its weight for them (the
    program's rows are within `amx_takes`'), else through the layer's own product (oneDNN's copy, torch's linear)."""
    if layer.amx_weight:
        weight, amx = layer.weight, ext.amx_linear
        return lambda x: amx(x, weight, bias, False)
    return lambda x: layer.linear(x, bias)


def _row_product(ext, layer: LinearBase) -> Product:
    """A row-parallel layer's forward on one rank: the product, then its bias added apart (as the layer adds it after
    its all-reduce)."""
    product = _product(ext, layer, None)
    if layer.bias is None:
        return product
    bias = layer.bias
    return lambda x: product(x) + bias
