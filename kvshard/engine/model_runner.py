"""Runs one step of the model on one rank: the same code on every rank of the world."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from kvshard.attention.backends import select_backend
from kvshard.attention.metadata import AttentionMetadata, decode_group_spread_from_env
from kvshard.attention.timing import DcpTimingGather
from kvshard.compilation import CompiledModel, compile_unavailable, opaque_parts
from kvshard.config import EngineConfig, ModelConfig
from kvshard.engine import cuda_graphs
from kvshard.engine.block_tables import RankBlockTables
from kvshard.engine.step_plan import StepPlan
from kvshard.forward_context import forward_context
from kvshard.host_pages import place_weights_on_huge_pages, weight_huge_pages
from kvshard.kv.cache import allocate_kv_cache, load_kv_scales
from kvshard.layers.batch_invariant import batch_invariant_mode
from kvshard.layers.linear import reorder_linear_weights
from kvshard.models.decode_program import DecodeProgram, program_unavailable
from kvshard.models.loader import load_weights
from kvshard.models.registry import model_class
from kvshard.parallel import ParallelState
from kvshard.spec_decode.proposer import make_draft_module

# the warm-up's dummy decode batches (their sizes: the compiled graph is one for every token count)
WARM_UP_TOKENS = (8, 1)


def load_module(build: Callable[[], torch.nn.Module], model_config: ModelConfig,
                device: torch.device) -> torch.nn.Module:
    """The one way a rank loads a module of a checkpoint (the target, a draft model, the MTP layer):
    `build()` made on `device`, its weights loaded from `model_config`'s checkpoint, linear weights
    reordered for the kernels, on a CPU moved onto huge pages (kvshard/host_pages.py), in eval mode."""
    with torch.device(device):
        module = build()
    load_weights(module, model_config.path, model_config.quantization)
    reorder_linear_weights(module)
    if weight_huge_pages(device):
        place_weights_on_huge_pages(module)
    return module.eval()


class ModelRunner:
    def __init__(self, config: EngineConfig, parallel: ParallelState, device: torch.device) -> None:
        self.config = config
        self.parallel = parallel
        self.device = device
        self.layout = config.dcp_layout
        model = config.model
        cls = model_class(model.architecture)
        self.model = load_module(lambda: cls(model.hf_config, model.dtype, parallel), model, device)
        scales = load_kv_scales(config.model.path, config.model.num_layers) \
            if config.kv_cache_dtype != config.model.dtype else None
        # decode steps replayed as CUDA graphs (engine/cuda_graphs.py) where they can be; None: eager
        graphs_off = cuda_graphs.graphs_unavailable(
            config, device.type,
            dist.get_backend(parallel.tp_group) if parallel.world_size > 1 and device.type == "cuda" else None)
        # the model step compiled (kvshard/compilation.py) where it can be; None: eager
        self.compile_off = compile_unavailable(config, device.type)
        # the graphs' padding and the compile warm-up write to one scratch block past the pool's
        self.scratch_block = config.num_kv_blocks if graphs_off is None or self.compile_off is None else None
        self.kv_caches = allocate_kv_cache(
            config.kv_cache_spec, config.num_kv_blocks + (self.scratch_block is not None), config.cache.block_size,
            config.model.dtype, device, config.kv_cache_dtype, scales
        )
        # the attention kernel's rounding depends on the key length a group is padded to: in
        # batch-invariant mode only decodes of equal local length share a group, so none is padded
        self.decode_group_spread = 0 if config.batch_invariant else decode_group_spread_from_env()
        self.attention_backend = select_backend(config.attention_backend, device)  # every step's metadata carries it
        # the speculative proposer's model (a draft model, the MTP layer) with its own cache, sharded as
        # the target's under the same block ids; None without one (kvshard/spec_decode/proposer.py)
        self.drafter = make_draft_module(config, parallel, device, self.metadata,
                                         lambda build, model_config: load_module(build, model_config, device))
        self.dcp_timing = DcpTimingGather(parallel)  # rank 0's .report: every rank's DCP time
        # every running request's block table, kept from plan to plan (plans carry changes: engine/block_tables.py)
        self.block_tables = RankBlockTables(device, config.scheduler.max_num_seqs,
                                            min(self.layout.num_virtual_blocks(config.scheduler.max_model_len) + 1, 4096))
        self.decode_graphs = cuda_graphs.GraphedDecode(self) if graphs_off is None else None
        if self.decode_graphs is not None and not self.decode_graphs.capture():
            self.decode_graphs = None
        self.opaque = opaque_parts(self.model)  # what a compiled graph calls out to, by index
        self.compiled: CompiledModel | None = None
        if self.compile_off is None:
            self.compiled = CompiledModel(self.model)
            try:
                self.compiled.warm_up(self._warm_up)  # every rank at once: the opaque parts' collectives meet
            except Exception as error:
                raise RuntimeError(f"compiling the model step failed ({type(error).__name__}: {error}); "
                                   "--enforce-eager (or -O 0) runs it eagerly") from error
        self.step_model = self.compiled or self.model  # what runs the target's forward
        if self.compiled is None and program_unavailable(config, device.type) is None:
            self.step_model = DecodeProgram(self.model, self.model)  # steps of context rows as one flat program

    @property
    def compile_seconds(self) -> float | None:
        """How long the start-up compilation took on this rank (None: eager)."""
        return self.compiled.compile_seconds if self.compiled is not None else None

    @torch.inference_mode()
    def _warm_up(self, model) -> None:
        """Dummy decode batches through `model`: requests of one token at position 0, all in the scratch
        block (no request's), so that compiling happens now and not in the first request's step."""
        for tokens in WARM_UP_TOKENS:
            meta = self.metadata([0] * tokens, [1] * tokens, [[self.scratch_block]] * tokens)
            input_ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
            with forward_context(meta, self.kv_caches, self.parallel, self.opaque):
                model(input_ids, meta.positions)

    def metadata(self, context_lens: list[int], query_lens: list[int], block_tables: list[list[int]] | None = None,
                 slots: list[int] | None = None) -> AttentionMetadata:
        """This rank's attention metadata of a step's requests: their tables whole (`block_tables`), or
        their `slots` in the persistent tables."""
        tables = self.block_tables.table if slots is not None else block_tables
        return AttentionMetadata.build(context_lens, query_lens, tables, self.layout, self.parallel.dcp_rank,
                                       self.device, self.decode_group_spread, self.attention_backend, slots)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes this rank allocated for KV (a view shared with the key is counted once)."""
        total = 0
        for layer in self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else []):
            total += layer.key.numel() * layer.key.element_size()
            if not layer.value_is_view:
                total += layer.value.numel() * layer.value.element_size()
        return total

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan; rank 0 gets float32 logits [len(sample_rows), V], the others None."""
        if plan.tables is not None:
            self.block_tables.apply(plan.tables)  # BlockTablesOutOfSync where this rank is not in step
        if self.decode_graphs is not None:
            replayed, logits = self.decode_graphs.execute(plan)
            if replayed:
                self.dcp_timing.after_step()
                return logits
        if plan.tables is not None:
            meta = self.metadata(plan.context_lens, plan.query_lens, slots=plan.tables.slots)
        else:  # a plan built by hand, with whole tables
            meta = self.metadata(plan.context_lens, plan.query_lens, plan.block_tables)
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(plan.sample_rows, dtype=torch.long, device=self.device)
        with batch_invariant_mode(self.config.batch_invariant):
            if plan.draft:
                logits = self.drafter.run_draft(plan, input_ids, meta, rows)
            else:
                with forward_context(meta, self.kv_caches, self.parallel, self.opaque):
                    states = self.step_model(input_ids, meta.positions)  # [t, D], before the final norm
                if self.drafter is not None:
                    self.drafter.after_target(plan, states)
                logits = self.model.compute_logits(states[rows])
        self.dcp_timing.after_step()
        return logits
