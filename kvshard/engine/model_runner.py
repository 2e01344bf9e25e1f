"""Runs one step of the model on one rank: the same code on every rank of the world."""

from __future__ import annotations

import torch

from kvshard.attention.metadata import AttentionMetadata, decode_group_spread_from_env
from kvshard.attention.timing import DcpTimingGather
from kvshard.config import EngineConfig
from kvshard.engine.step_plan import StepPlan
from kvshard.kv.cache import allocate_kv_cache
from kvshard.models.loader import load_weights
from kvshard.models.registry import model_class
from kvshard.parallel import ParallelState


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
        self.dcp_timing = DcpTimingGather(parallel)  # rank 0's .report: every rank's DCP time

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
        logits = self.model.compute_logits(hidden[rows])
        self.dcp_timing.after_step()
        return logits
