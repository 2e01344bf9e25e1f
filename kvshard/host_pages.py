"""Host memory on 2 MiB transparent huge pages: the buffers a CPU rank streams through every decode step.

A decode step on a CPU reads every weight and the whole live KV cache from memory. On 4 KiB pages each page of
such a stream costs a TLB miss and restarts the hardware prefetchers, which do not cross a 4 KiB boundary; on
2 MiB pages the same reads run faster (the KV cache's scattered blocks 1.09-1.28x cold, BENCHMARKS.md section
24; the linear layers' AMX products 1.07-1.28x, section 40). Linux gives a process huge pages for anonymous
memory it advises (`madvise(MADV_HUGEPAGE)`) when its THP mode is "madvise" or "always"; the size of a page is
fixed when it is first touched, so a buffer is advised before anything writes to it.

`huge_page_buffer` makes such a buffer; the KV cache is one (kv/cache.py's `kv_buffer`), and each rank's weights
are moved into one after loading (`place_weights_on_huge_pages`), in the order the modules hold them (a decode
step's order: each layer's weights in turn). Weights kept only as oneDNN's reordered copies (opaque tensors that
oneDNN allocates) stay where oneDNN put them.
"""

from __future__ import annotations

import mmap
import sys

import torch

from kvshard import envs

HUGE_PAGE_BYTES = 2 << 20
ALIGN = 64  # each storage in a shared buffer starts on a cache line


def transparent_huge_pages() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"); None where there is none."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def huge_pages_here(device: torch.device) -> bool:
    """Whether host memory on `device` can be advised for huge pages: a CPU under Linux whose kernel gives them on
    advice (or always)."""
    return (torch.device(device).type == "cpu" and sys.platform.startswith("linux")
            and transparent_huge_pages() in ("always", "madvise"))


def huge_pages_on_advice(device: torch.device, switch: str) -> bool:
    """`huge_pages_here`, unless the environment's `switch` (a KVSHARD_* variable) is 0."""
    return bool(envs.get(switch)) and huge_pages_here(device)


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` bytes [uint8] of fresh private anonymous memory (zero pages, none touched yet), aligned to 2 MiB,
    its whole huge pages advised for transparent huge pages; the memory lives as long as a view of it does."""
    room = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(room, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    advised = nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES  # whole huge pages inside the buffer
    if advised:
        room.madvise(mmap.MADV_HUGEPAGE, start, advised)  # advice: the kernel may still give 4 KiB pages
    return whole[start:start + nbytes]


def weight_huge_pages(device: torch.device) -> bool:
    """Whether a rank's weights on `device` go onto huge pages (KVSHARD_WEIGHT_HUGE_PAGES, on by default)."""
    return huge_pages_on_advice(device, "KVSHARD_WEIGHT_HUGE_PAGES")


def _movable_storage(tensor: torch.Tensor | None) -> torch.UntypedStorage | None:
    """The storage a CPU tensor lies in, None for one that cannot be moved (another device, an opaque oneDNN
    tensor, an empty one)."""
    if tensor is None or tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.is_mkldnn:
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # an OpaqueTensorImpl has no storage to read
        return None
    return storage if storage.nbytes() else None


def place_weights_on_huge_pages(module: torch.nn.Module) -> int:
    """Move every CPU parameter and buffer of `module` into one buffer on huge pages (`huge_page_buffer`), storage
    by storage in the order the modules hold them; returns the bytes moved. Tensors that share a storage (tied
    weights, views) share it after the move, with their offsets and strides; each tensor stays the same Python
    object (its `.data` is replaced), so what refers to it sees the new memory. Each old storage is freed as soon
    as its tensors are moved: at most one storage is held twice at a time."""
    slots: dict[int, list[tuple[dict, str]]] = {}  # storage address -> where its tensors are registered
    sizes: dict[int, int] = {}
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in table.items():
                storage = _movable_storage(tensor)
                if storage is not None:
                    slots.setdefault(storage.data_ptr(), []).append((table, name))
                    sizes[storage.data_ptr()] = storage.nbytes()
    if not slots:
        return 0
    total = sum(-(-size // ALIGN) * ALIGN for size in sizes.values())
    arena = huge_page_buffer(total)
    offset = 0
    for address, places in slots.items():
        size = sizes[address]
        target = arena[offset:offset + size]
        first = places[0][0][places[0][1]]
        target.copy_(torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage()))
        for table, name in places:
            tensor = table[name]
            if tensor.untyped_storage().data_ptr() != address:  # one object registered twice: moved already
                continue
            typed = target.view(tensor.dtype)  # as_strided's offset counts from the whole buffer's start
            tensor.data = typed.as_strided(tensor.shape, tensor.stride(), typed.storage_offset() + tensor.storage_offset())
        offset += -(-size // ALIGN) * ALIGN
        del first, tensor, target
    return total


def describe_pages(subject: str, switch: str, advised: str, device: torch.device | None = None) -> str:
    """The start-up report's line on the pages under `subject` (the KV cache, the weights) on `device` (by default
    a GPU where there is one, as the ranks choose, else the CPU): `advised` where they go onto huge pages (the
    environment's `switch` on), else why not."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cpu":
        return f"{subject} pages: the device's"
    mode = transparent_huge_pages()
    if huge_pages_on_advice(device, switch):
        return f"{subject} pages: {advised} (THP {mode}; {switch}=0 keeps the allocator's)"
    why = (f"{switch}=0" if not envs.get(switch)
           else "no transparent huge pages here" if mode is None else f"THP {mode}")
    return f"{subject} pages: the allocator's ({why})"


def describe_weight_pages(device: torch.device | None = None) -> str:
    """The start-up report's line on the pages under a rank's weights."""
    return describe_pages("weight", "KVSHARD_WEIGHT_HUGE_PAGES", "each rank's weights moved into one buffer advised "
                          "for 2 MiB transparent huge pages, oneDNN's reordered copies apart", device)
