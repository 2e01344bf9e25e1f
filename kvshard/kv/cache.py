"""One rank's paged KV cache: what a token costs in it, its layers, and their allocation.

The spec is derived here once from the model config; the engine config's byte
accounting and the runner's allocation both read it, so they cannot disagree.

With `kv_cache_dtype="fp8"` the cache stores float8 e4m3 (1 byte per value): keys and
values are divided by a per-tensor scale of their layer and saturated to e4m3's range
on write, and multiplied back in the compute dtype after the gather, so attention never
sees float8. The scales are 1.0 unless the checkpoint carries them (`k_scale`/`v_scale`).

On a CPU under Linux every layer's cache is a view of one buffer, aligned to 2 MiB and
advised for transparent huge pages before its first touch (`KVSHARD_KV_HUGE_PAGES`):
the paged kernel reads blocks that lie anywhere in it, and on 4 KiB pages each block's
pages cost a TLB miss and restart the hardware prefetchers (1.09-1.28x faster cold reads:
BENCHMARKS.md section 24).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvshard import host_pages
from kvshard.errors import ConfigError

if TYPE_CHECKING:
    from kvshard.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# vLLM's names for a layer's per-tensor KV scales: k_scale/v_scale, or one kv_scale for both
_KV_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\..*\b(k_scale|v_scale|kv_scale)$")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one token costs per layer on a rank: GQA keeps K and V per KV head;
    MLA keeps one latent [c_kv | k_pe] per token and reads c_kv as the value."""

    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    value_in_key: bool  # value = key[..., :value_dim] (MLA)

    @property
    def values_per_slot_per_layer(self) -> int:
        stored = self.key_dim if self.value_in_key else self.key_dim + self.value_dim
        return self.num_kv_heads * stored

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one physical cache slot (one token, all layers)."""
        element = torch.tensor([], dtype=dtype).element_size()
        return self.num_layers * self.values_per_slot_per_layer * element


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores: the model's for "auto", float8 e4m3 for "fp8"."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    raise ConfigError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported: use {', '.join(KV_CACHE_DTYPES)}")


@dataclass(frozen=True)
class KVScales:
    """One layer's per-tensor FP8 scales: the cache stores key / key_scale and value / value_scale."""

    key: float = 1.0
    value: float = 1.0


def load_kv_scales(path: Path, num_layers: int) -> list[KVScales]:
    """Each layer's scales as the checkpoint gives them (`*.k_scale`, `*.v_scale` or `*.kv_scale`), else 1.0."""
    from kvshard.models.loader import checkpoint_files, checkpoint_tensors  # the files the weights are read from

    found: dict[int, dict[str, float]] = {}
    for file in checkpoint_files(path):
        for name, read in checkpoint_tensors(file):
            if (match := _KV_SCALE_NAME.search(name)) is not None:
                layer, kind = int(match.group(1)), match.group(2)
                tensor = read()
                if tensor.numel() != 1:
                    raise ConfigError(f"{name} in {file} holds {tensor.numel()} values; kvshard reads one "
                                      "scale per tensor: use --kv-cache-dtype auto")
                scale = tensor.float().item()
                kinds = ("k_scale", "v_scale") if kind == "kv_scale" else (kind,)
                found.setdefault(layer, {}).update(dict.fromkeys(kinds, scale))
    for layer, scales in found.items():
        if layer >= num_layers or not all(s > 0 for s in scales.values()):
            raise ConfigError(f"{path}: the KV scales of layer {layer} ({scales}) are not positive scales of a "
                              f"model with {num_layers} layers; remove them or use --kv-cache-dtype auto")
    return [KVScales(found.get(i, {}).get("k_scale", 1.0), found.get(i, {}).get("v_scale", 1.0))
            for i in range(num_layers)]


def head_dim_of(hf_config) -> int:
    """A GQA model's head dim: configs that omit `head_dim` split the hidden size evenly."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def kv_cache_spec(model: ModelConfig, attention_tp_size: int) -> KVCacheSpec:
    """The cache one rank holds for `model` when attention splits its heads `attention_tp_size`
    (A = tp / dcp) ways.

    GQA gives each DCP group its 1/A share of the KV heads, at least one whole head (with A
    above the KV heads, groups hold replicas); its ranks split that share's tokens, so a rank
    stores kv_heads / A heads for 1/N of the tokens. MLA's latent is one "KV head" shared by
    all query heads: every group keeps it whole.
    """
    cfg = model.hf_config
    if model.is_mla:
        latent = cfg.kv_lora_rank
        return KVCacheSpec(cfg.num_hidden_layers, 1, key_dim=latent + cfg.qk_rope_head_dim, value_dim=latent,
                           value_in_key=True)
    d = head_dim_of(cfg)
    heads = max(1, cfg.num_key_value_heads // attention_tp_size)
    return KVCacheSpec(cfg.num_hidden_layers, heads, key_dim=d, value_dim=d, value_in_key=False)


@dataclass
class GatherBuffers:
    """A group's gathered keys and values, kept from one layer to the next within a step.

    A fresh multi-MB buffer every layer costs more in page faults than the copy itself;
    all layers of a step gather the same blocks, so they can share these.
    """

    key: torch.Tensor | None = None  # [g*nb, B, Hk, dk], compute dtype
    value: torch.Tensor | None = None  # [g*nb, B, Hk, dv], compute dtype
    stored: torch.Tensor | None = None  # [g*nb, B, Hk, d] as stored (FP8), before dequantizing


class KVCacheLayer:
    """One layer's cache on one rank: key [slots, Hk, dk] and value [slots, Hk, dv].

    The value may be a view into the key (MLA keeps [c_kv | k_pe] and reads c_kv as V),
    in which case only the key is written. A cache stored in FP8 is quantized on write and
    read back in `dtype`, the compute dtype.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, block_size: int, dtype: torch.dtype,
                 scales: KVScales = KVScales()) -> None:
        self.key = key
        self.value = value
        self.block_size = block_size
        self.dtype = dtype
        self.scales = scales
        self.value_is_view = value.data_ptr() == key.data_ptr()
        # a CPU cache the kernel extension's `write_kv` fills (not FP8: that rounds on the way in)
        self._direct = (key.device.type == "cpu" and key.dtype == dtype and key.dim() == 3 and key.is_contiguous()
                        and (self.value_is_view or (value.dtype == dtype and value.is_contiguous())))

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ops=None) -> None:
        """key [n, Hk, dk] and value [n, Hk, dv] (the value ignored where it is a view of the key) into `slots` [n].
        `ops`: the kernel extension where its fused operators are on (attention/fused_ops.py's `ops_for`), which
        writes both in one call on a CPU (an index_copy_ took 21 us at a decode step's 32 tokens); else, and for
        an FP8 cache, PyTorch's index_copy_."""
        if ops is not None and self._direct and key.dtype == self.dtype and slots.dtype == torch.int64:
            if self.value_is_view:
                ops.write_kv(self.key, None, slots, key, None)
                return
            if value.dtype == self.dtype:
                ops.write_kv(self.key, self.value, slots, key, value)
                return
        self._store(self.key, slots, key, self.scales.key)
        if not self.value_is_view:
            self._store(self.value, slots, value, self.scales.value)

    @staticmethod
    def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        if cache.dtype != FP8_DTYPE:
            cache.index_copy_(0, slots, x.to(cache.dtype))
            return
        cache.view(torch.uint8).index_copy_(0, slots, _to_fp8(x, scale).view(torch.uint8))  # no float8 index_copy_ on CPU

    @property
    def rounds(self) -> bool:
        """Whether what is written comes back changed (an FP8 cache)."""
        return self.key.dtype == FP8_DTYPE

    def as_read(self, key: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`key` and `value` as this cache gives them back once written: rounded to float8 and scaled back in an
        FP8 cache, unchanged in any other. A prefill chunk attends to its own tokens through this, so that a token
        sees every earlier token as stored whether it came from the cache (an earlier chunk, a prefix hit, a
        recomputation) or from its own step: how a prompt was split cannot change its outputs."""
        if not self.rounds:
            return key, value
        value_scale = self.scales.key if self.value_is_view else self.scales.value  # MLA: V is the key's channels
        return (_from_fp8(_to_fp8(key, self.scales.key), self.dtype, self.scales.key),
                None if value is None else _from_fp8(_to_fp8(value, value_scale), self.dtype, value_scale))

    def gather(self, blocks: torch.Tensor, buffers: GatherBuffers | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks [g, nb] -> keys [g, nb*B, Hk, dk], values [g, nb*B, Hk, dv], copied into `buffers`."""
        buffers = buffers if buffers is not None else GatherBuffers()
        buffers.key = self._by_block(self.key, blocks, buffers.key, self.scales.key, buffers)
        keys = buffers.key.view(blocks.shape[0], -1, *self.key.shape[1:])
        if self.value_is_view:  # MLA: V is the leading channels of the gathered latent
            return keys, keys[..., : self.value.shape[-1]]
        buffers.value = self._by_block(self.value, blocks, buffers.value, self.scales.value, buffers)
        return keys, buffers.value.view(blocks.shape[0], -1, *self.value.shape[1:])

    def _by_block(self, cache: torch.Tensor, blocks: torch.Tensor, reuse: torch.Tensor | None, scale: float,
                  buffers: GatherBuffers) -> torch.Tensor:
        """The blocks of `cache` in the compute dtype, [g*nb, B, Hk, d], written into `reuse` when it fits."""
        per_block = cache.unflatten(0, (-1, self.block_size))  # [num_blocks, B, Hk, d]
        shape = (blocks.numel(), *per_block.shape[1:])
        out = _reusable(reuse, shape, self.dtype, cache.device)
        if cache.dtype == self.dtype:
            torch.index_select(per_block, 0, blocks.flatten(), out=out)  # far faster than per_block[blocks] on CPU
            return out
        buffers.stored = _reusable(buffers.stored, shape, cache.dtype, cache.device)
        torch.index_select(per_block, 0, blocks.flatten(), out=buffers.stored)
        out.copy_(buffers.stored)  # exact: every e4m3 value is a bfloat16/float16/float32 value
        return out.mul_(scale) if scale != 1.0 else out


def _to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    # saturate explicitly: torch's scalar float -> e4m3fn conversion turns values beyond 448 into NaN
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _from_fp8(stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    out = stored.to(dtype)  # exact: every e4m3 value is a bfloat16/float16/float32 value
    return out.mul_(scale) if scale != 1.0 else out  # as a gathered read scales it (_by_block)


def _reusable(buffer: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
        return torch.empty(shape, dtype=dtype, device=device)
    return buffer


def kv_huge_pages(device: torch.device) -> bool:
    """Whether a rank's KV cache on `device` is allocated for transparent huge pages: a CPU under Linux whose
    kernel gives them on advice (or always), unless KVSHARD_KV_HUGE_PAGES=0."""
    return host_pages.huge_pages_on_advice(device, "KVSHARD_KV_HUGE_PAGES")


def describe_kv_pages(device: torch.device | None = None) -> str:
    """The start-up report's line on the pages under the KV cache."""
    return host_pages.describe_pages("KV cache", "KVSHARD_KV_HUGE_PAGES",
                                     "one buffer advised for 2 MiB transparent huge pages", device)


def kv_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` zero bytes [uint8]: where `kv_huge_pages`, fresh anonymous memory aligned to 2 MiB and advised for
    huge pages before anything touches it (a page's size is fixed at its first touch); the memory lives as long as
    a view of it does. On a CPU, a cache larger than the memory available is a ConfigError saying so (before: the
    allocator's error, or under overcommit the kernel's OOM killer as the pages are touched)."""
    if torch.device(device).type == "cpu":
        check_host_memory(nbytes)
    if not kv_huge_pages(device):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return host_pages.huge_page_buffer(nbytes).zero_()  # every page faulted in now, not in a step


def available_host_bytes() -> int | None:
    """/proc/meminfo's MemAvailable in bytes, or None where it cannot be read."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def check_host_memory(nbytes: int, ranks: int = 1) -> None:
    """Refuse host KV caches of more bytes than /proc/meminfo's MemAvailable (where it can be read): `nbytes` a
    rank, for `ranks` ranks on this host. Rank 0 checks every local rank's before starting them: each rank's own
    check, as it allocates, sees only the memory the others have not taken yet."""
    from kvshard.errors import ConfigError

    available = available_host_bytes()
    if available is not None and nbytes * ranks > available:
        where = "on this rank" if ranks == 1 else f"on each of the {ranks} ranks on this host"
        raise ConfigError(f"the KV cache takes {nbytes / 2**30:,.1f} GiB {where} but {available / 2**30:,.1f} "
                          "GiB of memory is available: lower --kv-cache-memory (or --num-kv-blocks)")


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, cache_dtype: torch.dtype | None = None,
                      scales: list[KVScales] | None = None) -> list[KVCacheLayer]:
    """Each layer's cache, stored in `cache_dtype` (default: the compute `dtype`) and read back in `dtype`: views
    of one zeroed buffer (`kv_buffer`), each layer's keys then its values."""
    cache_dtype = cache_dtype or dtype
    scales = scales or [KVScales()] * spec.num_layers
    slots = num_blocks * block_size
    item = torch.empty((), dtype=cache_dtype).element_size()
    key_elems = slots * spec.num_kv_heads * spec.key_dim
    value_elems = 0 if spec.value_in_key else slots * spec.num_kv_heads * spec.value_dim
    per_layer = key_elems + value_elems
    buffer = kv_buffer(len(scales) * per_layer * item, device).view(cache_dtype)
    layers = []
    for i, layer_scales in enumerate(scales):
        at = i * per_layer
        key = buffer[at:at + key_elems].view(slots, spec.num_kv_heads, spec.key_dim)
        value = key[..., : spec.value_dim] if spec.value_in_key else buffer[
            at + key_elems:at + per_layer].view(slots, spec.num_kv_heads, spec.value_dim)
        layers.append(KVCacheLayer(key, value, block_size, dtype, layer_scales))
    return layers
