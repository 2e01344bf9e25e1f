"""Runs one step of the model on one rank: the same code on every rank of the world."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

import torch

from kvshard.attention.metadata import AttentionMetadata, decode_group_spread_from_env
from kvshard.config import EngineConfig
from kvshard.kv.cache import allocate_kv_cache
from kvshard.models.loader import load_weights
from kvshard.models.registry import model_class
from kvshard.parallel import ParallelState


# A plan that runs nothing: rank 0 sends it when idle to learn that every rank still answers.
HEARTBEAT = "heartbeat"


@dataclass(frozen=True)
class StepPlan:
    """What rank 0 tells every rank to run: small, plain Python, broadcast once per step."""

    token_ids: list[int]  # new tokens of all requests, flattened
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows of the flat batch whose logits rank 0 needs


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.layout = config.dcp_layout
        hf_config = config.model.hf_config
        cls = model_class(config.model.architecture)
        with torch.device(device):
            self.model = cls(hf_config, config.model.dtype, parallel)
        load_weights(self.model, config.model.path, config.model.quantization)
        self.model.eval()
        self.kv_caches = allocate_kv_cache(
            config.kv_cache_spec, config.num_kv_blocks, config.cache.block_size, config.model.dtype, device
        )
        self.decode_group_spread = decode_group_spread_from_env()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes this rank allocated for KV (a view shared with the key is counted once)."""
        total = 0
        for layer in self.kv_caches:
            total += layer.key.numel() * layer.key.element_size()
            if not layer.value_is_view:
                total += layer.value.numel() * layer.value.element_size()
        return total

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan; rank 0 gets float32 logits [len(sample_rows), V], the others None."""
        meta = AttentionMetadata.build(
            plan.context_lens, plan.query_lens, plan.block_tables, self.layout, self.parallel.dcp_rank, self.device,
            self.decode_group_spread,
        )
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta, self.kv_caches)  # [t, D]
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])


def configure_cpu(world_size: int) -> None:
    """Ranks on one CPU machine share its cores instead of each taking all of them, and keep the
    memory they free for the next step."""
    if os.environ.get("KVSHARD_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["KVSHARD_NUM_THREADS"]))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    keep_freed_memory()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


def keep_freed_memory() -> None:
    """Stop glibc from handing freed memory back to the kernel between steps.

    A step allocates and frees the same multi-MB activations every time; by default glibc serves
    each from fresh mmap'd pages and returns them on free, so every step pays page faults and
    zeroing for memory it just had (measured: a third of a KV gather's time). With these settings
    the process keeps its high-water mark instead. glibc only; elsewhere, or with
    KVSHARD_KEEP_FREED_MEMORY=0, nothing changes.
    """
    if os.environ.get("KVSHARD_KEEP_FREED_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        pass
