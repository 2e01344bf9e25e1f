"""A rank's KV cache on a CPU is one buffer advised for transparent huge pages (kvshard/kv/cache.py): the paged
kernel reads blocks that lie anywhere in it, and on 4 KiB pages each block's pages cost a TLB miss and restart the
hardware prefetchers (BENCHMARKS.md section 24)."""

from __future__ import annotations

import pytest
import torch

from kvshard import host_pages
from kvshard.host_pages import HUGE_PAGE_BYTES
from kvshard.kv import cache as kv_cache
from kvshard.kv.cache import KVCacheSpec, allocate_kv_cache, describe_kv_pages

CPU = torch.device("cpu")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (kB, as /proc/self/smaps counts)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("huge", ["1", "0"])
@pytest.mark.parametrize("spec", [KVCacheSpec(3, 2, 16, 8, False), KVCacheSpec(3, 1, 40, 32, True)],
                         ids=["gqa", "mla"])
def test_every_layer_is_a_zeroed_view_of_its_own_part_of_one_buffer(spec, huge, monkeypatch):
    monkeypatch.setenv("KVSHARD_KV_HUGE_PAGES", huge)
    layers = allocate_kv_cache(spec, num_blocks=10, block_size=4, dtype=torch.float32, device=CPU,
                               cache_dtype=torch.bfloat16)
    assert len(layers) == 3
    for layer in layers:
        assert layer.key.shape == (40, spec.num_kv_heads, spec.key_dim) and layer.key.dtype == torch.bfloat16
        assert layer.value.shape == (40, spec.num_kv_heads, spec.value_dim)
        assert layer.key.is_contiguous() and not layer.key.any() and not layer.value.any()
        assert (layer.value.data_ptr() == layer.key.data_ptr()) == spec.value_in_key
    # one buffer: the layers lie back to back, and writing one leaves the others as they were
    per_layer = layers[0].key.numel() + (0 if spec.value_in_key else layers[0].value.numel())
    offsets = [layer.key.data_ptr() - layers[0].key.data_ptr() for layer in layers]
    assert offsets == [i * per_layer * 2 for i in range(3)]  # bfloat16: 2 bytes an element
    layers[1].key.fill_(1.0)
    layers[1].value.fill_(2.0)
    assert not layers[0].key.any() and not layers[2].key.any() and not layers[2].value.any()
    assert layers[1].key[..., spec.value_dim:].eq(1.0).all() and layers[1].value.eq(2.0).all()


def test_a_cache_of_whole_huge_pages_gets_them_where_the_kernel_gives_them(monkeypatch):
    if not kv_cache.kv_huge_pages(CPU):
        pytest.skip(f"no transparent huge pages on advice here: {describe_kv_pages(CPU)}")
    monkeypatch.setenv("KVSHARD_KV_HUGE_PAGES", "1")
    spec = KVCacheSpec(2, 1, 64, 64, False)  # 2 layers x (K + V) x 512 B a slot: 8 MiB for 8,192 slots
    layers = allocate_kv_cache(spec, num_blocks=512, block_size=16, dtype=torch.float32, device=CPU)
    start = layers[0].key.data_ptr()
    assert start % HUGE_PAGE_BYTES == 0
    if _anon_huge_kib(start) < 2048 and not _the_kernel_gives_huge_pages():
        pytest.skip("the kernel gave no huge page to an advised mapping of its own either (none free)")
    assert _anon_huge_kib(start) >= 2048


def _the_kernel_gives_huge_pages() -> bool:
    """Whether a fresh private mapping of 8 MiB, advised and touched here, gets any huge page: the advice is a
    request, which a kernel without free huge pages refuses."""
    import mmap

    room = mmap.mmap(-1, 4 * HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(room, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    room.madvise(mmap.MADV_HUGEPAGE, start, 2 * HUGE_PAGE_BYTES)
    whole[start:start + 2 * HUGE_PAGE_BYTES].fill_(1)
    return _anon_huge_kib(whole.data_ptr()) > 0


def test_without_huge_pages_the_cache_is_the_allocators_zeros(monkeypatch):
    monkeypatch.setenv("KVSHARD_KV_HUGE_PAGES", "0")
    assert not kv_cache.kv_huge_pages(CPU)
    assert describe_kv_pages(CPU) == "KV cache pages: the allocator's (KVSHARD_KV_HUGE_PAGES=0)"
    layers = allocate_kv_cache(KVCacheSpec(1, 1, 8, 8, False), 4, 4, torch.float32, CPU)
    assert not layers[0].key.any()


@pytest.mark.parametrize("mode, wanted", [
    ("madvise", "KV cache pages: one buffer advised for 2 MiB transparent huge pages (THP madvise; "
                "KVSHARD_KV_HUGE_PAGES=0 keeps the allocator's)"),
    ("always", "KV cache pages: one buffer advised for 2 MiB transparent huge pages (THP always; "
               "KVSHARD_KV_HUGE_PAGES=0 keeps the allocator's)"),
    ("never", "KV cache pages: the allocator's (THP never)"),
    (None, "KV cache pages: the allocator's (no transparent huge pages here)"),
])
def test_the_start_up_report_says_which_pages(mode, wanted, monkeypatch):
    monkeypatch.delenv("KVSHARD_KV_HUGE_PAGES", raising=False)
    monkeypatch.setattr(host_pages, "transparent_huge_pages", lambda: mode)
    monkeypatch.setattr(host_pages.sys, "platform", "linux")
    assert describe_kv_pages(CPU) == wanted
    assert describe_kv_pages(torch.device("meta")) == "KV cache pages: the device's"
