"""A CPU rank's weights moved onto transparent huge pages once loaded (kvshard/host_pages.py): every parameter and
buffer into one buffer, storage by storage, ties and views kept, the same Python objects, the same bits; the
decode floor's bandwidth measured on those pages too."""

from __future__ import annotations

import pytest
import torch

from kvshard import LLM, SamplingParams, host_pages
from kvshard.host_pages import HUGE_PAGE_BYTES, describe_weight_pages, place_weights_on_huge_pages

from conftest import tiny_llama_config
from test_kv_pages import _anon_huge_kib, _the_kernel_gives_huge_pages

CPU = torch.device("cpu")


class _Tied(torch.nn.Module):
    """Weights as models hold them: two modules sharing one Parameter (tied embeddings), two Parameters over one
    storage, a buffer that is a strided view into the middle of another, and another dtype."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight
        whole = torch.randn(8, 6)
        self.left = torch.nn.Parameter(whole[:, :3], requires_grad=False)
        self.right = torch.nn.Parameter(whole[:, 3:], requires_grad=False)
        table = torch.randn(10, 10, dtype=torch.bfloat16)
        self.register_buffer("table", table)
        self.register_buffer("diagonal", table.diagonal(offset=1))
        self.register_buffer("absent", None)


def _movable(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's tensors that can move (oneDNN's opaque reordered copies cannot)."""
    return [t for t in [*module.parameters(), *module.buffers()] if host_pages._movable_storage(t) is not None]


def _address_range(module: torch.nn.Module) -> tuple[int, int]:
    tensors = _movable(module)
    return min(t.data_ptr() for t in tensors), max(t.data_ptr() + t.numel() * t.element_size() for t in tensors)


def test_every_weight_moves_into_one_buffer_with_its_ties_views_and_bits():
    module = _Tied()
    before = {name: t.clone() for name, t in [*module.named_parameters(remove_duplicate=False),
                                              *module.named_buffers()]}
    objects = {name: id(t) for name, t in module.named_parameters(remove_duplicate=False)}
    old_addresses = {t.data_ptr() for t in [*module.parameters(), *module.buffers()]}
    moved = place_weights_on_huge_pages(module)
    assert moved == 64 * 16 * 4 + 8 * 6 * 4 + 256  # three storages, each from a cache line (200 bytes: 256)
    low, high = _address_range(module)
    assert high - low <= moved and not old_addresses & {t.data_ptr() for t in module.parameters()}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() % 64 == 0 or name in ("right", "diagonal")
    assert {name: id(t) for name, t in module.named_parameters(remove_duplicate=False)} == objects
    assert module.head.weight is module.embed.weight
    assert module.right.data_ptr() == module.left.data_ptr() + 3 * 4  # one storage, its offsets kept
    assert module.right.stride() == (6, 1)
    assert module.diagonal.data_ptr() == module.table.data_ptr() + 2 and module.diagonal.stride() == (11,)
    module.table[0, 1] = 7.0  # a view still sees its base
    assert module.diagonal[0] == 7.0
    x = torch.randint(0, 64, (5,))
    assert torch.equal(module.head(module.embed(x)), torch.nn.functional.linear(before["embed.weight"][x],
                                                                                before["embed.weight"]))


def test_opaque_and_other_device_tensors_stay_where_they_are():
    from kvshard.layers.linear import onednn_reordered

    module = torch.nn.Module()
    module.register_buffer("plain", torch.ones(4))
    packed = onednn_reordered(torch.randn(32, 32))
    module.register_buffer("packed", packed)
    module.register_buffer("meta", torch.empty(4, device="meta"))
    module.register_buffer("empty", torch.empty(0))
    assert place_weights_on_huge_pages(module) == 64
    assert module.packed is packed and module.meta.device.type == "meta" and module.plain.eq(1).all()
    assert place_weights_on_huge_pages(torch.nn.Linear(2, 2, device="meta")) == 0


def test_a_large_weight_gets_huge_pages_where_the_kernel_gives_them():
    if not host_pages.huge_pages_here(CPU):
        pytest.skip(f"no transparent huge pages on advice here: {describe_weight_pages(CPU)}")
    module = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB
    place_weights_on_huge_pages(module)
    start = module.weight.data_ptr()
    assert start % HUGE_PAGE_BYTES == 0
    if _anon_huge_kib(start) < 2048 and not _the_kernel_gives_huge_pages():
        pytest.skip("the kernel gave no huge page to an advised mapping of its own either (none free)")
    assert _anon_huge_kib(start) >= 2048


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_on_huge_pages_gives_the_tokens_of_one_without(dtype, checkpoints, monkeypatch):
    """The loaded model's weights lie in one huge-page buffer (or stay apart with the switch off) and greedy tokens
    and logprobs are the same either way (bfloat16: the AMX products, where the CPU has tiles, read the moved
    weights as they lie; float32: oneDNN's reordered copies stay, the rest moves)."""
    if not host_pages.huge_pages_here(CPU):
        pytest.skip(f"no transparent huge pages on advice here: {describe_weight_pages(CPU)}")
    model = checkpoints("tiny-llama-pages", tiny_llama_config(tie_word_embeddings=True))
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8]]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("KVSHARD_WEIGHT_HUGE_PAGES", switch)
        with LLM(str(model), dtype=dtype, kv_cache_memory="2MiB", max_model_len=64) as llm:
            loaded = llm.engine.runner.model
            tensors = _movable(loaded)
            assert len(tensors) > 4
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
            low, high = _address_range(loaded)
            if switch == "1":  # one buffer from a huge page's start: nothing between them but alignment
                assert low % HUGE_PAGE_BYTES == 0
                assert high - low <= sum(-(-n // 64) * 64 for n in storages.values())
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            runs[switch] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize("mode, switch, wanted", [
    ("madvise", None, "weight pages: each rank's weights moved into one buffer advised for 2 MiB transparent huge "
                      "pages, oneDNN's reordered copies apart (THP madvise; KVSHARD_WEIGHT_HUGE_PAGES=0 keeps the "
                      "allocator's)"),
    ("always", "0", "weight pages: the allocator's (KVSHARD_WEIGHT_HUGE_PAGES=0)"),
    ("never", None, "weight pages: the allocator's (THP never)"),
    (None, None, "weight pages: the allocator's (no transparent huge pages here)"),
])
def test_the_start_up_report_says_which_pages(mode, switch, wanted, monkeypatch):
    if switch is None:
        monkeypatch.delenv("KVSHARD_WEIGHT_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("KVSHARD_WEIGHT_HUGE_PAGES", switch)
    monkeypatch.setattr(host_pages, "transparent_huge_pages", lambda: mode)
    monkeypatch.setattr(host_pages.sys, "platform", "linux")
    assert describe_weight_pages(CPU) == wanted
    assert describe_weight_pages(torch.device("meta")) == "weight pages: the device's"


@pytest.mark.parametrize("here", [True, False])
def test_the_floors_bandwidth_is_the_better_of_both_pages(here, monkeypatch):
    from kvshard.bench import decode_floor

    made = []
    real = host_pages.huge_page_buffer

    def counted(nbytes):
        made.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(host_pages, "huge_pages_here", lambda device: here)
    monkeypatch.setattr(host_pages, "huge_page_buffer", counted)
    rate = decode_floor.copy_bandwidth(num_bytes=1 << 20, repeats=2)
    assert rate > 0
    assert made == ([1 << 20, 1 << 20] if here else [])
