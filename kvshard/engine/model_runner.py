"""Runs one step of the model on one rank: the same code on every rank of the world."""

from __future__ import annotations

import torch

from kvshard.attention.backends import select_backend
from kvshard.attention.metadata import AttentionMetadata, decode_group_spread_from_env
from kvshard.attention.timing import DcpTimingGather
from kvshard.config import EngineConfig, ModelConfig
from kvshard.engine.step_plan import StepPlan
from kvshard.kv.cache import allocate_kv_cache, kv_cache_spec, load_kv_scales
from kvshard.layers.batch_invariant import batch_invariant_mode
from kvshard.layers.linear import reorder_linear_weights
from kvshard.models.deepseek import DeepseekMultiTokenPredictor
from kvshard.models.loader import load_weights
from kvshard.models.registry import model_class
from kvshard.parallel import ParallelState


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.layout = config.dcp_layout
        self.model = self._load_model(config.model)
        scales = load_kv_scales(config.model.path, config.model.num_layers) \
            if config.kv_cache_dtype != config.model.dtype else None
        self.kv_caches = allocate_kv_cache(
            config.kv_cache_spec, config.num_kv_blocks, config.cache.block_size, config.model.dtype, device,
            config.kv_cache_dtype, scales
        )
        # a speculative draft model: its own cache, sharded as the target's, under the same block ids
        draft = config.speculative.draft_model_config if config.speculative is not None else None
        self.draft_model = self.draft_kv_caches = None
        if draft is not None:
            self.draft_model = self._load_model(draft)
            self.draft_kv_caches = allocate_kv_cache(
                kv_cache_spec(draft, config.parallel.attention_tp_size), config.num_kv_blocks,
                config.cache.block_size, draft.dtype, device)
        # an MTP module: its own one-layer cache, sharded as the target's, under the same block ids
        self.mtp = self.mtp_kv_cache = None
        self.mtp_hidden: torch.Tensor | None = None  # [rows, D]: the states the next MTP draft pass reads
        if config.speculative is not None and config.speculative.method == "mtp":
            with torch.device(device):
                self.mtp = DeepseekMultiTokenPredictor(config.model.hf_config, config.model.dtype, parallel)
            load_weights(self.mtp, config.model.path, config.model.quantization)
            reorder_linear_weights(self.mtp)
            self.mtp.eval()
            (self.mtp_kv_cache,) = allocate_kv_cache(config.mtp_kv_cache_spec, config.num_kv_blocks,
                                                     config.cache.block_size, config.model.dtype, device)
        # the attention kernel's rounding depends on the key length a group is padded to: in
        # batch-invariant mode only decodes of equal local length share a group, so none is padded
        self.decode_group_spread = 0 if config.batch_invariant else decode_group_spread_from_env()
        self.attention_backend = select_backend(config.attention_backend, device)  # every step's metadata carries it
        self.dcp_timing = DcpTimingGather(parallel)  # rank 0's .report: every rank's DCP time

    def _load_model(self, model_config: ModelConfig) -> torch.nn.Module:
        cls = model_class(model_config.architecture)
        with torch.device(self.device):
            model = cls(model_config.hf_config, model_config.dtype, self.parallel)
        load_weights(model, model_config.path, model_config.quantization)
        reorder_linear_weights(model)
        return model.eval()

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes this rank allocated for KV (a view shared with the key is counted once)."""
        total = 0
        for layer in self.kv_caches + (self.draft_kv_caches or []) + ([self.mtp_kv_cache] if self.mtp else []):
            total += layer.key.numel() * layer.key.element_size()
            if not layer.value_is_view:
                total += layer.value.numel() * layer.value.element_size()
        return total

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan; rank 0 gets float32 logits [len(sample_rows), V], the others None."""
        meta = AttentionMetadata.build(
            plan.context_lens, plan.query_lens, plan.block_tables, self.layout, self.parallel.dcp_rank, self.device,
            self.decode_group_spread, self.attention_backend,
        )
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        with batch_invariant_mode(self.config.batch_invariant):
            if plan.draft and self.mtp is not None:
                hidden = self.mtp(input_ids, self.mtp_hidden[plan.hidden_rows], meta, self.mtp_kv_cache)  # [t, D]
                self.mtp_hidden = hidden  # the next draft starts from this one's output
                logits = self.mtp.compute_logits(hidden[rows])
            else:
                model, caches = (self.draft_model, self.draft_kv_caches) if plan.draft else (self.model, self.kv_caches)
                states = model(input_ids, meta, caches)  # [t, D], before the final norm
                if plan.next_token_ids is not None:
                    self._mtp_after_target(plan, states)
                logits = model.compute_logits(states[rows])
        self.dcp_timing.after_step()
        return logits

    def _mtp_after_target(self, plan: StepPlan, states: torch.Tensor) -> None:
        """Write the MTP cache entry of every row whose next token the plan gives (with the target's
        states of this step: exact as far as the drafts they follow are accepted, and rewritten from the
        first rejected one on), and keep the rows the next draft pass starts from. The states are
        replicated over TP after the last all-reduce, so every rank has them: nothing is sent."""
        context_lens, query_lens, block_tables, start = [], [], [], 0
        for ctx, n, table in zip(plan.context_lens, plan.query_lens, plan.block_tables):
            known = sum(token >= 0 for token in plan.next_token_ids[start : start + n])  # a prefix of its rows
            start += n
            if known:
                context_lens.append(ctx)
                query_lens.append(known)
                block_tables.append(table)
        known_rows = [row for row, token in enumerate(plan.next_token_ids) if token >= 0]
        if known_rows:
            meta = AttentionMetadata.build(context_lens, query_lens, block_tables, self.layout, self.parallel.dcp_rank,
                                           self.device, self.decode_group_spread, self.attention_backend)
            next_ids = torch.tensor([plan.next_token_ids[r] for r in known_rows], dtype=torch.long, device=self.device)
            self.mtp(next_ids, states[known_rows], meta, self.mtp_kv_cache)
        self.mtp_hidden = states[plan.keep_rows]  # [kept rows, D]
