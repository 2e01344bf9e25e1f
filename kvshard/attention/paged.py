"""Paged attention on CPU: the query rows of a step read the KV cache through the block table,
where it lies, and get their output with its natural-log LSE (csrc/paged_attention.cpp).

The kernel is a small C++ extension compiled on first use with `torch.utils.cpp_extension`
(a C++ compiler and the `ninja` package) and cached in the user's cache directory, once per
machine (`kernel_cache_dir`), in a folder named by a hash of its source, its flags, the CPU and
the torch version, so another CPU or flag set builds its own; processes that start together wait
for one build (torch's file lock) and later ones load it. What is compiled is a copy of the source
kept in that folder, so that checkouts of the same source (at other paths) share one build rather
than rebuild it in turn. `python -m kvshard.attention.build_kernel` builds it ahead (`make install`
does). Where it cannot be built, kvshard says
so in one line and `paged_attention` runs the gather path (a copy of the blocks and
`attention_with_lse`), with the same results.

Rows: row r of q reads the sequence `row_seq[r]` of `block_tables` and sees that sequence's first
`row_lens[r]` tokens on this rank. A rank's share of a DCP interleave is packed densely into
its blocks (kv/layout.py), so what a row sees is always a prefix; `row_lens_of` builds the
bounds from global context lengths, the layout and a rank, one bound per query row (several
rows of one request each see up to their own position).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvshard import envs
from kvshard.attention import kernels
from kvshard.attention.kernels import attention_with_lse
from kvshard.kv.layout import DCPLayout

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
# -fopenmp: at::parallel_for is a header template that runs its loop on torch's OpenMP threads only where the
# extension itself is compiled with OpenMP (torch defines INTRA_OP_PARALLEL under _OPENMP); without it every call
# ran on one thread. The libgomp.so.1 it links is torch's own, already loaded under that name.
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_module = None
_unavailable: str | None = None  # why the kernel could not be built, once known


def cache_dir() -> Path:
    """Where kvshard keeps what it builds: KVSHARD_CACHE_DIR, else ~/.cache/kvshard."""
    return envs.cache_dir()


def kernel_cache_dir() -> Path:
    """Where the compiled kernel is kept: KVSHARD_KERNEL_CACHE_DIR, else the user's cache
    ($XDG_CACHE_HOME or ~/.cache)/kvshard/torch_extensions, shared by every run on the machine
    (the test suite, which points KVSHARD_CACHE_DIR elsewhere, included); where that cannot be
    written, KVSHARD_CACHE_DIR/torch_extensions."""
    configured = envs.get("KVSHARD_KERNEL_CACHE_DIR")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME", "").strip() or Path.home() / ".cache")
    user = base / "kvshard" / "torch_extensions"
    try:
        user.mkdir(parents=True, exist_ok=True)
        if os.access(user, os.W_OK):
            return user
    except OSError:
        pass
    return cache_dir() / "torch_extensions"


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def _native_flags() -> list[str]:
    """-march=native where the compiler takes it on this machine (x86 and ARM gcc/clang)."""
    return ["-march=native"] if platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64") else []


def _build_name(flags: list[str]) -> str:
    """The build's directory name: everything the compile command holds. The include paths of torch and Python
    too: ninja rebuilds when its command changes, so two environments with the same versions at different paths
    (two venvs, or one reached through two symlinks) sharing one build would rebuild it at every other start."""
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(flags).encode(), _cpu_signature().encode(),
                 torch.__version__.encode(), platform.python_version().encode(), _SOURCE.name.encode(),
                 str(Path(torch.__file__).parent).encode(), sysconfig.get_paths()["include"].encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"kvshard_paged_attention_{digest.hexdigest()[:16]}"


def _ninja_on_path() -> bool:
    """torch runs `ninja` from PATH; the PyPI package puts it next to the interpreter, which a
    venv's python started by its path does not have on PATH."""
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # the PyPI package
    except ImportError:
        return False
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and Path(bin_dir, "ninja").exists():
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        return True
    return False


def load_extension():
    """The compiled kernel, built on first use (cached across runs), or None where it cannot be
    built (logged once with the reason)."""
    global _module, _unavailable
    if _module is not None or _unavailable is not None:
        return _module
    with _lock:
        if _module is not None or _unavailable is not None:
            return _module
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            _unavailable = f"no C++ compiler ({compiler}) found"
        elif not _ninja_on_path():
            _unavailable = "ninja not found (pip install ninja)"
        else:
            flags = _FLAGS + _native_flags()
            name = _build_name(flags)
            build_dir = kernel_cache_dir() / name
            try:
                build_dir.mkdir(parents=True, exist_ok=True)
                from torch.utils.cpp_extension import load
                fresh = not (build_dir / f"{name}.so").exists()
                if fresh:  # the first use on this machine: say why the start takes a minute
                    print(f"kvshard: building the paged attention kernel in {build_dir} (once per machine, "
                          "about a minute)", file=sys.stderr, flush=True)
                start = time.perf_counter()
                with _builder_lock(build_dir):
                    # the build runs on a copy at a fixed path: ninja rebuilds when a source's path changes
                    source = build_dir / _SOURCE.name
                    if not source.exists():
                        shutil.copyfile(_SOURCE, source)
                    _module = load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=_LDFLAGS,
                                   build_directory=str(build_dir), verbose=False)
                if fresh:
                    print(f"kvshard: paged attention kernel built in {time.perf_counter() - start:.0f} s",
                          file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001 - any build failure falls back, with its reason
                last = (str(exc).strip().splitlines() or [""])[-1]
                _unavailable = f"building it in {build_dir} failed ({type(exc).__name__}: {last})"
        if _unavailable is not None:
            logger.warning("kvshard: the paged attention kernel is unavailable: %s; attention uses the gather path",
                           _unavailable)
        return _module


@contextlib.contextmanager
def _builder_lock(build_dir: Path):
    """One builder at a time on this machine, by a lock the system drops when its holder dies. torch's
    own lock is a file that a build killed midway leaves behind, on which every later start would wait
    forever: holding ours, no other builder is alive, so such a file is stale and goes."""
    with open(build_dir.parent / f"{build_dir.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kernel_available() -> bool:
    return load_extension() is not None


def kernel_path() -> str | None:
    """Which of the kernel's paths this machine's build runs: its AVX-512 tiles (and AMX tiles for bfloat16 keys
    where `amx_ready`) or its portable loops (None where it is not built)."""
    module = load_extension()
    if module is None:
        return None
    if not module.tiled:
        return "portable loops"
    return "AVX-512 tiles" + ("; AMX tiles for bfloat16 keys of head size 32 to 128" if amx_ready() else "")


def amx_ready() -> bool:
    """Whether bfloat16 attention runs on the kernel's AMX tiles here (the rows over the paged cache with keys of
    head size 32 to 128, and long chunks with no mask): KVSHARD_AMX_ATTENTION is not 0,
    the kernel is loaded (by the paged backend, or `kernel_available`: this never builds it, so a process on the
    gather backend keeps the flash kernel), its build has the path (a CPU with AMX tiles and a compiler that knows
    them) and the system gave this process the tiles' state."""
    return bool(envs.get("KVSHARD_AMX_ATTENTION")) and _amx_built()


def _amx_built() -> bool:
    module = _module
    return module is not None and bool(module.amx_ready())


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool, key_range: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [g, s, H, d] over k, v [g, L, Hk, d] (bfloat16, d 32, 64 or 128) on AMX tiles: o [g, s, H, d] and lse [g, s, H]
    (float32); causal (s == L): token t sees keys <= t, else every key. Where `amx_ready`. The keys are packed into
    the tiles' layout `key_range` at a time (a multiple of 512; 0: 16,384), so a long context's packed copy stays that
    size; the result does not depend on it."""
    out, lse = load_extension().amx_attention(q, k, v, float(scale), bool(causal), int(key_range))
    return out, lse


# attention_with_lse takes the AMX path through these (looked up at each call: tests replace them)
kernels.register_amx_path(lambda: amx_ready(), lambda *args: amx_attention(*args))


def unavailable_reason() -> str | None:
    """Why the kernel could not be built, once a build was tried; None where it was built (or not tried)."""
    return _unavailable


def paged_attention(
    q: torch.Tensor,  # [t, H, dk] float32 / bfloat16 / float16
    key_cache: torch.Tensor,  # [slots, Hk, dk] or [num_blocks, B, Hk, dk]
    value_cache: torch.Tensor,  # [slots, Hk, dv] or [num_blocks, B, Hk, dv]; may be key_cache[..., :dv]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    row_seq: torch.Tensor,  # [t]: the block-table row each query row reads
    row_lens: torch.Tensor,  # [t]: how many of that sequence's local tokens the row sees
    block_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    split_tokens: int = 0,  # tokens per piece when the sequence is split; 0: the kernel decides
    use_kernel: bool | None = None,  # None: the kernel where it is built; False: the gather path
    portable: bool = False,  # the kernel's portable loops even where its AVX-512 tiles are built (tests, benchmarks)
    vector_lanes: bool = True,  # False: the tiles keep tokens in the lanes for every item (tests, benchmarks)
    amx_tiles: bool | None = None,  # None: bfloat16 keys of head size 32-128 on AMX tiles where `amx_ready`
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each row of q over its visible cached tokens: o [t, H, dv] and lse [t, H],
    float32, natural log (views of one [t, H, dv + 1], `packed_of`); a row that sees no token
    gets o = 0 and lse = -inf. A cache stored in
    float8 e4m3 holds key / k_scale and value / v_scale (kv/cache.py)."""
    if key_cache.dim() == 4:
        key_cache, value_cache = key_cache.flatten(0, 1), value_cache.flatten(0, 1)
    module = load_extension() if use_kernel is not False else None
    if use_kernel and module is None:
        raise RuntimeError(f"the paged attention kernel is unavailable: {_unavailable}")
    tables = block_tables.to(torch.int32).contiguous()
    seqs = row_seq.to(torch.int32).contiguous()
    lens = row_lens.to(torch.int32).contiguous()
    if module is not None and q.device.type == "cpu":
        packed = module.paged_attention(q if q.stride(-1) == 1 else q.contiguous(), key_cache, value_cache,
                                        tables, seqs, lens, block_size, scale, k_scale, v_scale, split_tokens,
                                        portable, vector_lanes, amx_ready() if amx_tiles is None else amx_tiles)
        return packed[..., :-1], packed[..., -1]  # views of one [t, H, dv + 1]: see packed_of
    return gather_attention(q, key_cache, value_cache, tables, seqs, lens, block_size, scale, k_scale, v_scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's causal attention to its own keys, through the kernel: q [t, H, dk], k [t, Hk, dk] and
    v [t, Hk, dv] of one request are read where they lie as one block of t slots, row i seeing keys 0..i, as the
    kernel reads a request's speculative verification rows. No padding of V to K's width (PyTorch's flash kernel
    needs one head size: MLA's chunks, 64-channel keys and 32-channel values in the demo, paid a third more).
    o [t, H, dv] and lse [t, H], float32 (views of one [t, H, dv + 1], `packed_of`)."""
    return _one_block(q, k, v, scale, torch.arange(1, q.shape[0] + 1, dtype=torch.int32))


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of q [t, H, dk] over all of k [L, Hk, dk] and v [L, Hk, dv] (one request's keys, no mask), through
    the kernel, which reads them where they lie as one block of L slots: o [t, H, dv] and lse [t, H], float32 (views
    of one [t, H, dv + 1], `packed_of`). MLA's cached context in the expanded form (attention/backend.py)."""
    return _one_block(q, k, v, scale, torch.full((q.shape[0],), k.shape[0], dtype=torch.int32))


def _one_block(q, k, v, scale: float, row_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over one request's k and v read as a single block of their L slots, row r seeing the first
    row_lens[r] of them."""
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))  # the kernel reads rows of channels
    return paged_attention(q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.zeros(q.shape[0], dtype=torch.int32),
                           row_lens, max(k.shape[0], 1), scale, use_kernel=True)


def gather_attention(q, key_cache, value_cache, block_tables, row_seq, row_lens, block_size: int, scale: float,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_attention` by copying each sequence's blocks out and running `attention_with_lse`:
    the fallback, and a second oracle for the tests. Consecutive rows of one sequence go together."""
    t, num_heads = q.shape[0], q.shape[1]
    out, lse = empty_packed(t, num_heads, value_cache.shape[-1], q.device)
    seqs, lens = row_seq.tolist(), row_lens.tolist()
    compute = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    key_blocks = key_cache.unflatten(0, (-1, block_size))
    value_blocks = value_cache.unflatten(0, (-1, block_size))
    r = 0
    while r < t:
        e = r + 1
        while e < t and seqs[e] == seqs[r]:
            e += 1
        longest = max(lens[r:e])
        if longest > 0:
            nb = -(-longest // block_size)
            ids = block_tables[seqs[r], :nb].long()
            keys = _dequantized(key_blocks[ids], compute, k_scale).flatten(0, 1)[None]  # [1, nb*B, Hk, dk]
            values = _dequantized(value_blocks[ids], compute, v_scale).flatten(0, 1)[None]
            span = torch.arange(nb * block_size, device=q.device)
            bound = torch.tensor(lens[r:e], device=q.device)
            bias = torch.zeros(1, e - r, span.numel(), device=q.device).masked_fill_(
                span[None, None] >= bound[None, :, None], float("-inf"))
            o, l = attention_with_lse(q[r:e][None].to(compute), keys, values, bias, scale)
            out[r:e], lse[r:e] = o[0], l[0]
        r = e
    return out, lse


def empty_packed(t: int, heads: int, dv: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """o [t, heads, dv] = 0 and lse [t, heads] = -inf, float32: views of one [t, heads, dv + 1]."""
    packed = torch.zeros(t, heads, dv + 1, dtype=torch.float32, device=device)
    packed[..., -1] = float("-inf")
    return packed[..., :-1], packed[..., -1]


def packed_of(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[t, H, dv + 1]: o and lse side by side, without a copy where they are views of one such
    tensor (the kernel's output, `empty_packed`), else concatenated. Told by where they lie, not by `Tensor._base`:
    under `torch.inference_mode` (the engine's steps) a view records no base."""
    if out.dim() == 3 and lse.dim() == 2 and out.dtype == lse.dtype and out.device == lse.device:
        t, heads, dv = out.shape
        strides = (heads * (dv + 1), dv + 1, 1)
        if (t and heads and tuple(lse.shape) == (t, heads) and out.stride() == strides
                and lse.stride() == strides[:2] and lse.storage_offset() == out.storage_offset() + dv
                and out.untyped_storage().data_ptr() == lse.untyped_storage().data_ptr()):
            return out.as_strided((t, heads, dv + 1), strides)
    return torch.cat([out, lse.unsqueeze(-1)], dim=-1)


def _dequantized(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if x.dtype == dtype and scale == 1.0:
        return x
    y = x.to(dtype)
    return y.mul_(scale) if scale != 1.0 else y


def row_lens_of(context_lens: Sequence[int], query_lens: Sequence[int], layout: DCPLayout, dcp_rank: int,
                causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_seq, row_lens) [t] int32 for requests whose K/V are all in the cache (written first).

    Request i has `context_lens[i]` tokens cached (its new rows included) and `query_lens[i]`
    query rows, the last ones of those tokens. With `causal`, row j of it sees the global tokens
    up to its own position, context - query_len + j + 1; without, every row sees them all. The
    bounds are this rank's local counts of those tokens under `layout`.
    """
    seqs, visible = [], []
    for i, (ctx, n) in enumerate(zip(context_lens, query_lens)):
        for j in range(n):
            seqs.append(i)
            visible.append(ctx - n + j + 1 if causal else ctx)
    global_lens = torch.tensor(visible, dtype=torch.long)
    return torch.tensor(seqs, dtype=torch.int32), layout.local_lens_of(global_lens, dcp_rank).to(torch.int32)
