"""Attention backends: what one rank computes of an attention layer, below the DCP rhythm.

The rhythm (attention/backend.py: the Q all-gather, the merge by LSE, the ReduceScatter or
all-to-all) stays above and does not care which backend did the work. A backend does three things:

- `write`: the step's new K/V into this rank's paged cache (the tokens it owns);
- `attend_context`: the attention of the step's context rows over this rank's cached tokens,
  returning o [c, H, dv] and its natural-log lse [c, H], float32 (a row that sees no cached token,
  a DCP rank holding none of a short request, gets o = 0 and lse = -inf); the two may be views of
  one [c, H, dv + 1] (`paged.packed_of`), which the DCP merge then sends without a copy. Row r of the step sees
  the first `meta.row_lens[r]` local tokens of request `meta.row_seq[r]`;
- `attend_chunks`: each prefill chunk's causal attention to itself (the K/V every rank of the
  group computed), merged above with the context part by LSE;
- `attend_keys`: rows of one request over keys and values given whole, no mask (MLA's long chunks
  read their cached context in the expanded form: attention/backend.py).

Four of them, chosen once at start-up (`--attention-backend`, EngineConfig.attention_backend):

- `reference`: plain matmuls over each row's tokens, picked by indexing; any device; the test oracle.
- `gather`: each group's blocks copied out (`KVCacheLayer.gather`), then PyTorch's CPU flash
  kernel (`attention_with_lse`).
- `paged`: the C++ kernel of attention/paged.py, one call for every context row, reading the
  blocks where they lie, and a call for each long chunk's attention to itself, reading its K/V where
  they lie; CPU only, built on first use.
- `triton`: the Triton kernels of attention/triton_paged.py, the same reads on a GPU (on a CPU
  only under Triton's interpreter: the tests).

`auto` is `triton` on CUDA where triton is installed, `paged` where the kernel builds on a CPU with
AVX-512 (the vector width its tiles are sized for), else `gather`, with one line saying why. On an
AVX2-only CPU the kernel ran at 0.07-0.5x the gather + flash path (BENCHMARKS.md, section 14):
`--attention-backend paged` still runs it there.

A backend with `causal_rows` also takes the rows of short chunks after cached context (speculative
verification rows, the rest of a prompt after a prefix hit) whole: their own K/V are in the cache
by then, so each row reads up to its own position there (`AttentionMetadata.build`), and no chunk
attention or merge is left for them.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Protocol

import torch

from kvshard import envs
from kvshard.attention import paged
from kvshard.attention.fused_ops import ops_for
from kvshard.attention.kernels import attention_with_lse, reference_attention_with_lse
from kvshard.errors import ConfigError
from kvshard.layers.batch_invariant import batch_invariant_active

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.kv.cache import KVCacheLayer

logger = logging.getLogger(__name__)

AUTO, PAGED, GATHER, REFERENCE, TRITON = "auto", "paged", "gather", "reference", "triton"
ATTENTION_BACKENDS = (AUTO, PAGED, GATHER, REFERENCE, TRITON)
# In batch-invariant mode the kernel never splits a row's tokens: where it splits depends on the batch.
NO_SPLIT = 1 << 40
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the paged kernel's query dtypes


class AttentionBackend(Protocol):
    name: str
    causal_rows: bool  # reads several rows of one request with a bound each (short chunks go here whole)

    def write(self, cache: KVCacheLayer, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's new k [t, Hk, dk] and v [t, Hk, dv]: this rank's tokens into its cache."""
        ...

    def attend_context(self, q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """o [c, H, dv], lse [c, H] (float32) of the context rows q [c, H, dk] over the cache."""
        ...

    def attend_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """o [t, H, dv], lse [t, H] (float32): causal attention inside each chunk that attends to
        itself (`group.attends_itself`); every other row o = 0, lse = -inf. Query head h reads KV head
        h // (H / Hk)."""
        ...

    def attend_keys(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """o [t, H, dv], lse [t, H] (float32): every row of q [t, H, dk] over all of one request's k [L, Hk, dk] and
        v [L, Hk, dv], no mask (MLA's cached context in the expanded form). Query head h reads KV head h // (H / Hk)."""
        ...


def _value_scale(cache: KVCacheLayer) -> float:
    # MLA reads its value from the key's channels: stored with the key's scale
    return cache.scales.key if cache.value_is_view else cache.scales.value


def _quantized(cache: KVCacheLayer) -> bool:
    return cache.key.dtype != cache.dtype


class _Backend:
    name = ""
    causal_rows = False

    def write(self, cache, meta, k, v):
        if meta.writes_every_token:  # no index copy of k and v (every decode without DCP)
            cache.write(meta.write_slots, k, v, ops_for(k))
        elif meta.write_index.numel():
            cache.write(meta.write_slots, k[meta.write_index], v[meta.write_index], ops_for(k))

    def attend_chunks(self, q, k, v, meta, scale):
        out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=torch.float32)
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        for group in meta.groups:
            if not group.attends_itself:
                continue
            rows = slice(group.start, group.end)
            o, l = self._causal(q[rows][None], k[rows][None], v[rows][None], scale)
            out[rows], lse[rows] = o[0], l[0]
        return out, lse

    def attend_keys(self, q, k, v, scale):
        """o [t, H, dv], lse [t, H] (float32): every row of q [t, H, dk] over all of one request's keys k [L, Hk, dk]
        and values v [L, Hk, dv], no mask (MLA's cached context in the expanded form, attention/backend.py)."""
        o, l = attention_with_lse(q[None], k[None], v[None], None, scale)  # no mask: on CUDA torch's fused kernels
        return o[0], l[0]

    @staticmethod
    def _causal(q, k, v, scale):
        return attention_with_lse(q, k, v, None, scale, causal=True)

    def __repr__(self) -> str:
        return f"<attention backend {self.name}>"


class ReferenceBackend(_Backend):
    """Plain matmuls over each row's visible tokens, picked by indexing the cache: any device, any dtype."""

    name = REFERENCE
    causal_rows = True

    def attend_context(self, q, cache, meta, scale):
        t, heads = q.shape[:2]
        out, lse = paged.empty_packed(t, heads, cache.value.shape[-1], q.device)
        b = cache.block_size
        tables = meta.block_tables  # [rows, width] int32 (the persistent tables: a row read per request)
        for r, (seq, n) in enumerate(zip(meta.row_seq[:t].tolist(), meta.row_lens[:t].tolist())):
            if n == 0:
                continue
            j = torch.arange(n, device=tables.device)
            slots = tables[seq].long()[j // b] * b + j % b
            keys, values = cache.key[slots].float(), cache.value[slots].float()
            if _quantized(cache):  # the stored values are x / scale
                keys, values = keys * cache.scales.key, values * _value_scale(cache)
            bias = torch.zeros(1, 1, n, device=q.device)
            o, l = reference_attention_with_lse(q[r:r + 1][None].float(), keys[None], values[None], bias, scale)
            out[r], lse[r] = o[0, 0], l[0, 0]
        return out, lse

    @staticmethod
    def _causal(q, k, v, scale):
        s = q.shape[1]
        bias = torch.full((s, s), float("-inf"), device=q.device).triu_(1).unsqueeze(0)
        return reference_attention_with_lse(q, k, v, bias, scale)


class GatherBackend(_Backend):
    """Each group's blocks gathered into its buffers (reused by the step's layers), then PyTorch's
    CPU flash kernel; the rows of a group all see its requests' whole cached context. (Metadata built
    for a backend with `causal_rows` may hold chunks read row by row: their blocks are copied out per
    request, `paged.gather_attention`.)"""

    name = GATHER

    def attend_context(self, q, cache, meta, scale):
        t, heads = q.shape[:2]
        out, lse = paged.empty_packed(t, heads, cache.value.shape[-1], q.device)
        for group in meta.groups:
            if group.start >= t:
                continue
            rows = slice(group.start, group.end)
            if group.rows_in_cache:
                quantized = _quantized(cache)
                out[rows], lse[rows] = paged.gather_attention(
                    q[rows], cache.key, cache.value, meta.block_tables, meta.row_seq[rows], meta.row_lens[rows],
                    cache.block_size, scale, cache.scales.key if quantized else 1.0,
                    _value_scale(cache) if quantized else 1.0)
                continue
            if group.context_blocks is not None:  # else this rank holds none of these requests' tokens yet
                out[rows], lse[rows] = _gathered_context(q[rows], cache, group, scale)
        return out, lse


def _gathered_context(q, cache, group, scale):
    """A group's rows over its requests' whole cached context: their blocks gathered into the group's
    buffers (reused by the step's layers), then PyTorch's flash kernel; (out, lse) per row."""
    keys, values = cache.gather(group.context_blocks, group.buffers)  # [g, L, Hk, dk], [g, L, Hk, dv]
    queries = q.unflatten(0, (group.num_seqs, group.query_len))  # [g, s, H, dk]
    length = group.shared_context_len
    if length is not None:  # every request holds `length` tokens here: no bias to add to each score (a fifth of
        # the flash kernel's time over such a context, BENCHMARKS.md section 34)
        o, l = attention_with_lse(queries, keys[:, :length], values[:, :length], None, scale)
    else:
        o, l = attention_with_lse(queries, keys, values, group.context_bias, scale)
    return o.flatten(0, 1), l.flatten(0, 1)


class PagedBackend(_Backend):
    """The C++ paged kernel: one call for every context row, reading the blocks where they lie."""

    name = PAGED
    causal_rows = True

    def __init__(self) -> None:
        if not paged.kernel_available():
            raise RuntimeError(f"the paged attention kernel is unavailable: {paged.unavailable_reason()}")

    def attend_context(self, q, cache, meta, scale):
        # every context row in the kernel, a long chunk's rows too (they all see the same cached context): prompts
        # of two chunks prefilled 1.1-1.6x faster than with those rows' blocks gathered for the flash kernel
        # (BENCHMARKS.md section 20; in section 10, before the kernel's tiles, the kernel had been 2.5x slower),
        # except where the flash kernel multiplies on AMX tiles (`flash_for_chunks`): there a long chunk's rows
        # read their gathered context in it (3.0-3.6x the kernel in bfloat16, section 33), decodes stay in the kernel
        c = q.shape[0]
        invariant = batch_invariant_active()
        long = ([] if invariant or not flash_for_chunks(q.dtype) else
                [group for group in meta.groups if group.start < c and group.attends_itself])
        if not long:  # a step of decodes and short chunks: one kernel call, its packed output as it is
            return self._paged(q, cache, meta, scale, slice(0, c), invariant)
        out, lse = paged.empty_packed(c, q.shape[1], cache.value.shape[-1], q.device)
        run = 0  # the first row of the kernel's current run of rows
        for group in long:
            if run < group.start:
                out[run:group.start], lse[run:group.start] = self._paged(
                    q[run:group.start], cache, meta, scale, slice(run, group.start), invariant)
            rows = slice(group.start, group.end)
            if group.context_blocks is not None:  # else this rank holds none of these requests' tokens yet
                out[rows], lse[rows] = _gathered_context(q[rows], cache, group, scale)
            run = group.end
        if run < c:
            out[run:c], lse[run:c] = self._paged(q[run:c], cache, meta, scale, slice(run, c), invariant)
        return out, lse

    def attend_chunks(self, q, k, v, meta, scale):
        """Each chunk's causal attention to itself in the kernel too (the chunk's K/V read in place, one
        request's rows each up to its own position), no V padded to K's width: 1.4-2.2x PyTorch's flash kernel on
        MLA's expanded chunks in float32 on one thread (BENCHMARKS.md section 20). The batch-invariant mode keeps the
        flash kernel for them, as does a CPU where that kernel multiplies on AMX tiles (`flash_for_chunks`)."""
        if (batch_invariant_active() or q.dtype not in _KERNEL_DTYPES or k.dtype != v.dtype
                or flash_for_chunks(q.dtype)):
            return super().attend_chunks(q, k, v, meta, scale)
        out, lse = paged.empty_packed(q.shape[0], q.shape[1], v.shape[-1], q.device)
        for group in meta.groups:
            if group.attends_itself:
                rows = slice(group.start, group.end)
                out[rows], lse[rows] = paged.causal_attention(q[rows], k[rows], v[rows], scale)
        return out, lse

    def attend_keys(self, q, k, v, scale):
        if q.dtype not in _KERNEL_DTYPES or not (k.dtype == v.dtype == q.dtype) or flash_for_chunks(q.dtype):
            return super().attend_keys(q, k, v, scale)
        return paged.full_attention(q, k, v, scale)

    @staticmethod
    def _paged(q, cache, meta, scale, rows: slice, invariant: bool):
        quantized = _quantized(cache)
        return paged.paged_attention(
            q, cache.key, cache.value, meta.block_tables, meta.row_seq[rows], meta.row_lens[rows], cache.block_size,
            scale, k_scale=cache.scales.key if quantized else 1.0, v_scale=_value_scale(cache) if quantized else 1.0,
            split_tokens=NO_SPLIT if invariant else 0, use_kernel=True)


class TritonBackend(_Backend):
    """The Triton kernels of attention/triton_paged.py: the paged path on a GPU (on a CPU only under
    Triton's interpreter, for the tests). Every context row in one call, each up to its own bound."""

    name = TRITON
    causal_rows = True

    def __init__(self, static_max_len: int | None = None) -> None:
        """`static_max_len`: a bound on every row's local tokens, known in advance, so the kernel's split
        is chosen without reading the lengths back from the device (what a CUDA graph's capture needs:
        engine/cuda_graphs.py); None: from the step's longest row."""
        from kvshard.attention import triton_paged

        why = triton_paged.available()
        if why is not None:
            raise RuntimeError(f"the Triton attention backend cannot run here: {why}")
        self._kernel = triton_paged.triton_paged_attention
        self.static_max_len = static_max_len

    def attend_context(self, q, cache, meta, scale):
        c = q.shape[0]
        quantized = _quantized(cache)
        return self._kernel(
            q, cache.key, cache.value, meta.block_tables, meta.row_seq[:c], meta.row_lens[:c], cache.block_size,
            scale, k_scale=cache.scales.key if quantized else 1.0, v_scale=_value_scale(cache) if quantized else 1.0,
            num_splits=1 if batch_invariant_active() else 0, max_len=self.static_max_len)


BACKENDS: dict[str, type[_Backend]] = {REFERENCE: ReferenceBackend, GATHER: GatherBackend, PAGED: PagedBackend,
                                        TRITON: TritonBackend}


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (bfloat16 tile products), which PyTorch's CPU flash kernel multiplies on."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(supported()) if supported is not None else False


def flash_for_chunks(dtype: torch.dtype) -> bool:
    """Whether the paged backend runs a long prefill chunk's attention (to itself, to its cached context, MLA's
    expanded context) in PyTorch's flash kernel rather than its own: `KVSHARD_FLASH_CHUNKS` where set, else for
    bfloat16 queries on a CPU with AMX tiles, where that kernel's tile products ran a chunk 1.5-4.3x faster than the
    paged kernel's vector loops (BENCHMARKS.md section 33). Decodes and short chunks stay in the paged kernel, which
    reads their blocks in place. float16 has no AMX products on such a CPU (AMX-FP16 aside) and float32 none at all:
    there the kernel is as fast or faster."""
    forced = envs.get("KVSHARD_FLASH_CHUNKS")
    if forced is not None:
        return bool(forced)
    return dtype == torch.bfloat16 and amx_tiles()


def _triton_unavailable() -> str | None:
    from kvshard.attention import triton_paged

    return triton_paged.available()


def cpu_capability() -> str:
    """torch's name for this CPU's vector instructions: AVX512, AVX2, ... (DEFAULT where it has none)."""
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return get() if get is not None else "DEFAULT"


def kernel_width_fits() -> bool:
    """Whether the paged kernel's tiles (16-lane float vectors, four query vectors by four keys) fit this
    CPU's registers: AVX-512. With AVX2 they spill, and the gather + flash path is faster."""
    return cpu_capability().startswith("AVX512")


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def resolve_backend_name(requested: str = AUTO, device_type: str | None = None) -> str:
    """The backend `requested` names on this machine: `auto` is `paged` where the kernel builds on a
    CPU, else `gather` (logged in one line); `paged` where it cannot build is a ConfigError."""
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(f"attention_backend={requested!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == AUTO:
        if device_type == "cuda":
            return TRITON if _triton_unavailable() is None else GATHER
        if device_type != "cpu":
            return GATHER
        if not kernel_width_fits():
            _log_once(f"attention backend auto: gather, not the paged kernel (this CPU's vector capability is "
                      f"{cpu_capability()}; the kernel's tiles are sized for AVX-512)")
            return GATHER
        return PAGED if paged.kernel_available() else GATHER  # load_extension logs the one line why not
    if requested == TRITON and _triton_unavailable() is not None:
        raise ConfigError(f"attention_backend='triton': {_triton_unavailable()}: use --attention-backend auto")
    if requested == PAGED:
        if device_type != "cpu":
            raise ConfigError(f"attention_backend='paged' runs on CPU only, not {device_type}: use gather or auto")
        if not paged.kernel_available():
            raise ConfigError(f"attention_backend='paged': the paged attention kernel is unavailable "
                              f"({paged.unavailable_reason()}): use --attention-backend gather or auto")
    return requested


def describe_backend(name: str, dtype: torch.dtype | None = None) -> str:
    """One line of the start-up report (`dtype`: the model's, which decides where the paged backend's long chunks
    attend)."""
    if name == PAGED:
        line = f"attention backend: paged (C++ kernel reading the paged KV cache in place: {paged.kernel_path()})"
        if dtype is not None and flash_for_chunks(dtype):
            forced = envs.get("KVSHARD_FLASH_CHUNKS")
            notes = ["KVSHARD_FLASH_CHUNKS=1"] if forced else []
            if dtype == torch.bfloat16 and paged.amx_ready():
                where = ("on AMX tiles: the kernel's AMX path at head sizes 32, 64 and 128 with no mask, else "
                         "PyTorch's flash kernel")
                notes.append("KVSHARD_AMX_ATTENTION=0: flash for all")
            else:
                where = "in PyTorch's flash kernel"
                notes += [] if forced else ["its AMX tile products"]
            notes += [] if forced else ["KVSHARD_FLASH_CHUNKS=0 keeps them in the kernel's vector loops"]
            line += f"; prefill chunks of more than 16 rows {where} ({'; '.join(notes)})"
        return line
    if name == TRITON:
        return "attention backend: triton (Triton kernels reading the paged KV cache in place)"
    if name == GATHER:
        why = paged.unavailable_reason()
        if why is None and not kernel_width_fits():
            return ("attention backend: gather (blocks copied out, then PyTorch's flash kernel); auto takes it on "
                    f"a CPU without AVX-512 ({cpu_capability()}), where the paged kernel is slower")
        return ("attention backend: gather (blocks copied out, then PyTorch's flash kernel)"
                + (f"; the paged kernel is unavailable: {why}" if why else ""))
    return f"attention backend: {name}"


def make_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {', '.join(BACKENDS)}")
    return BACKENDS[name]()


def select_backend(name: str, device: torch.device | None = None) -> AttentionBackend:
    """The backend `name` (or `auto`) names for `device`: what a model runner gives every step's metadata."""
    return make_backend(resolve_backend_name(name, device.type if device is not None else None))


_default: AttentionBackend | None = None


def default_backend() -> AttentionBackend:
    """`auto`'s backend, for metadata built without one (tests, tools): made once per process."""
    global _default
    if _default is None:
        _default = select_backend(AUTO)
    return _default
