"""Decode steps replayed as CUDA graphs: one graph per batch size of a fixed set, a batch padded up.

A decode step launches a few kernels per layer for a handful of tokens; on a GPU its time is
mostly the launches. A CUDA graph records the step's launches once, over fixed input buffers,
and replays them in one call. So at start-up each rank captures the whole decode step (every
layer, the DCP collectives on NCCL inside it, the logits) for batches of 1, 2, 4, 8, 16, then
every 16 up to 256 and every 64 after, and `max_num_seqs` (`capture_sizes`); a step of n decodes copies its inputs into the buffers
of the smallest captured size >= n, the rows past n padded (`DecodeInputs.load`: they read no
token, write their K/V to a scratch block no request owns), replays, and keeps the first n rows
of the logits. Every rank sees the same step plan, so every rank replays the same graph, and the
collectives inside meet.

What a graph cannot do is fixed at capture: so the attention over the cache runs the Triton
kernel with a split sized for the longest sequence `max_model_len` allows (no host read of the
lengths, attention/backends.py `TritonBackend(static_max_len=...)`), and a step that is not a
batch of plain decodes (a prefill chunk, speculative rows, a draft model's step, more rows than
the largest size) runs eagerly as before. Graphs are used only on CUDA, with the Triton backend,
one rank or NCCL collectives (gloo's cannot be captured), no speculative proposer, no MoE layers
(their experts are picked on the host) and outside batch-invariant mode (`graphs_unavailable` says
why not); `--enforce-eager` turns them off. On a CPU they are never used.

The bookkeeping (sizes, padding, capture once per size, replay, slicing) is plain Python over a
`GraphApi`; tests drive it with a stand-in that re-runs the step on the buffers (`RerunGraphApi`,
tests/test_cuda_graphs.py), scripts/device_check.py replays real graphs against eager steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvshard.attention.metadata import AttentionMetadata
    from kvshard.config import EngineConfig
    from kvshard.engine.step_plan import StepPlan


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every 16 up to 256, every 64 after; `max_num_seqs` itself last."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size = size * 2 if size < 16 else size + (16 if size < 256 else 64)
    return sizes + [max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows; None when n exceeds them all (run eagerly)."""
    return next((size for size in sizes if size >= n), None) if n > 0 else None


def graphs_unavailable(config: EngineConfig, device_type: str, collectives: str | None = None) -> str | None:
    """Why decode steps run eagerly on this engine, or None where they replay CUDA graphs.
    `collectives`: the TP group's backend ("nccl", "gloo"; None with one rank)."""
    if config.enforce_eager:
        return "--enforce-eager"
    if device_type != "cuda":
        return "CUDA graphs are for CUDA devices; this engine runs on the CPU"
    if config.attention_backend != "triton":
        return f"the {config.attention_backend} attention backend cannot be captured (triton can)"
    if config.speculative is not None:
        return "speculative decoding steps are not captured"
    cfg = config.model.hf_config
    routed = getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or 0
    if routed and getattr(cfg, "first_k_dense_replace", 0) < cfg.num_hidden_layers:
        return "the MoE layers pick their experts on the host, which a graph cannot capture"
    if config.batch_invariant:
        return "--batch-invariant: the captured kernel's split would depend on the batch size"
    if config.parallel.world_size > 1 and collectives != "nccl":
        return f"the ranks' collectives run on {collectives or 'gloo'} (ranks sharing a GPU), which cannot be captured"
    return None


def describe_decode_graphs(config: EngineConfig, device_type: str | None = None) -> str:
    """One line of the start-up report."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    collectives = None
    if config.parallel.world_size > 1 and device_type == "cuda":
        from kvshard.parallel import collective_backend, _local_world_size

        collectives = collective_backend(device_type, torch.cuda.device_count(),
                                         _local_world_size(config.parallel.world_size))
    why = graphs_unavailable(config, device_type, collectives)
    if why is not None:
        return f"decode steps: eager ({why})"
    sizes = capture_sizes(config.scheduler.max_num_seqs)
    shown = ", ".join(map(str, sizes)) if len(sizes) <= 8 else ", ".join(map(str, sizes[:6])) + f", ..., {sizes[-1]}"
    return f"decode steps: CUDA graphs for batches of {shown} (padded up; --enforce-eager turns them off)"


class GraphApi(Protocol):
    """What the manager needs of CUDA graphs (a stand-in in the tests)."""

    def new_graph(self) -> Any: ...
    def warm_up(self, step: Callable[[], Any]) -> None: ...
    def capture(self, graph: Any, pool: Any, step: Callable[[], Any]) -> Any: ...  # step() recorded; its output
    def pool(self, graph: Any) -> Any: ...
    def replay(self, graph: Any) -> None: ...  # the recorded work again, into the same output tensors


class CudaGraphApi:
    """torch.cuda's graphs: warm-up on a side stream (kernels compiled, workspaces allocated), capture
    into one memory pool shared by every size (largest first, so the smaller reuse its blocks)."""

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def warm_up(self, step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def capture(self, graph, pool, step):
        with torch.cuda.graph(graph, pool=pool):
            return step()

    def pool(self, graph):
        return graph.pool()

    def replay(self, graph):
        graph.replay()


class RerunGraphApi:
    """A stand-in for CUDA graphs on a CPU (tests, `scripts/device_check.py --dry-run`): capture runs the
    step once and keeps it; replay runs it again over the same buffers and copies the result into the
    output captured, which is what a graph's replay amounts to. Counts what it did."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # rows of each output captured, in order (-1: no output)
        self.warmed = 0
        self.replayed = 0

    def new_graph(self):
        return {"step": None, "output": None}

    def warm_up(self, step):
        self.warmed += 1
        step()

    def capture(self, graph, pool, step):
        graph["step"], graph["output"] = step, step()
        self.captured.append(graph["output"].shape[0] if graph["output"] is not None else -1)
        return graph["output"]

    def pool(self, graph):
        return None

    def replay(self, graph):
        self.replayed += 1
        fresh = graph["step"]()
        if graph["output"] is not None:
            graph["output"].copy_(fresh)


@dataclass
class DecodeInputs:
    """The fixed buffers of one captured size: every tensor a decode step reads."""

    input_ids: torch.Tensor  # [B] long
    positions: torch.Tensor  # [B] long
    write_slots: torch.Tensor  # [B] long: this rank's slot of each new token, the scratch slot where it owns none
    block_tables: torch.Tensor  # [B, max_blocks] int32
    row_seq: torch.Tensor  # [B] int32: row r reads sequence r
    row_lens: torch.Tensor  # [B] int32: local tokens row r sees (0 for padding)
    scratch_block: int

    @classmethod
    def allocate(cls, size: int, max_blocks: int, scratch_block: int, block_size: int,
                 device: torch.device) -> "DecodeInputs":
        long = dict(dtype=torch.long, device=device)
        return cls(input_ids=torch.zeros(size, **long), positions=torch.zeros(size, **long),
                   write_slots=torch.full((size,), scratch_block * block_size, **long),
                   block_tables=torch.full((size, max_blocks), scratch_block, dtype=torch.int32, device=device),
                   row_seq=torch.arange(size, dtype=torch.int32, device=device),
                   row_lens=torch.zeros(size, dtype=torch.int32, device=device), scratch_block=scratch_block)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def load(self, input_ids: torch.Tensor, meta: AttentionMetadata, block_size: int) -> None:
        """A step of n <= size decodes, its metadata built eagerly (on any device): rows [0, n) get
        it, rows [n, size) padding; what is copied never changes a buffer's address."""
        n = input_ids.shape[0]
        # each decode row's own table (row r reads table row_seq[r]: the step's tables, or the rank's persistent
        # ones, engine/block_tables.py), cut to the captured width: execute() let in no request with more blocks,
        # and the entries past a request's blocks are never read (row_lens bound the kernel)
        tables = meta.block_tables.index_select(0, meta.row_seq[:n].to(torch.long))
        width = self.block_tables.shape[1]
        if tables.shape[1] > width and bool(tables[:, width:].any()):  # a table's blocks past the captured width
            used = int((tables != 0).long().cumsum(1).argmax(1).max()) + 1
            raise ValueError(f"a block table of {used} blocks exceeds the captured {width}")
        tables = tables[:, :width]
        scratch_slot = self.scratch_block * block_size
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.input_ids[n:].zero_()
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.positions[n:].zero_()
        self.write_slots.fill_(scratch_slot)  # the tokens another DCP rank owns, and the padding
        if meta.write_index.numel():
            self.write_slots.index_copy_(0, meta.write_index.to(self.write_slots.device),
                                         meta.write_slots.to(self.write_slots.device))
        self.block_tables.fill_(self.scratch_block)
        self.block_tables[:n, :tables.shape[1]].copy_(tables, non_blocking=True)
        self.row_lens.zero_()
        self.row_lens[:n].copy_(meta.row_lens, non_blocking=True)


class DecodeGraphs:
    """Capture `step(inputs) -> output` once per size (`capture`), then `run` a step of n rows on
    the smallest size that holds it: its inputs loaded into that size's buffers, the graph
    replayed, the output's first n rows returned (None stays None: ranks other than 0)."""

    def __init__(self, step: Callable[[DecodeInputs], torch.Tensor | None],
                 make_inputs: Callable[[int], DecodeInputs], sizes: list[int], api: GraphApi | None = None) -> None:
        self.step = step
        self.make_inputs = make_inputs
        self.sizes = sorted(sizes)
        self.api = api if api is not None else CudaGraphApi()
        self.graphs: dict[int, tuple[Any, DecodeInputs, torch.Tensor | None]] = {}
        self.replays = 0  # steps run from a graph (tests, device_check)

    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in its memory
            inputs = self.make_inputs(size)
            self.api.warm_up(lambda inputs=inputs: self.step(inputs))
            graph = self.api.new_graph()
            output = self.api.capture(graph, pool, lambda inputs=inputs: self.step(inputs))
            pool = pool if pool is not None else self.api.pool(graph)
            self.graphs[size] = (graph, inputs, output)

    def size_for(self, n: int) -> int | None:
        return padded_size(n, self.sizes)

    def run(self, n: int, load: Callable[[DecodeInputs], None]) -> torch.Tensor | None:
        """`load(inputs)` fills the buffers of the size chosen for n rows (`DecodeInputs.load`)."""
        size = self.size_for(n)
        if size is None or size not in self.graphs:
            raise ValueError(f"no graph holds a batch of {n} rows (captured: {sorted(self.graphs)})")
        graph, inputs, output = self.graphs[size]
        load(inputs)
        self.api.replay(graph)
        self.replays += 1
        return None if output is None else output[:n]


def is_plain_decode(plan: StepPlan) -> bool:
    """A step of decodes only, each sampling its one row, in order: what a graph replays."""
    n = len(plan.query_lens)
    return (not plan.draft and n > 0 and all(q == 1 for q in plan.query_lens)
            and list(plan.sample_rows) == list(range(n)))


class GraphedDecode:
    """A model runner's decode graphs: captured at start-up (`capture`), replayed for each plain decode
    step that fits (`execute`, None where the step must run eagerly)."""

    def __init__(self, runner, api: GraphApi | None = None) -> None:
        from kvshard.attention.backends import TritonBackend
        from kvshard.attention.metadata import AttentionGroup, AttentionMetadata
        from kvshard.forward_context import forward_context

        self.runner = runner
        config = runner.config
        self.block_size = config.cache.block_size
        self.max_blocks = -(-config.scheduler.max_model_len // self.block_size)
        self.scratch_block = config.num_kv_blocks  # the one block past the pool's (allocated by the runner)
        # a split sized for the longest sequence there can be: no host read of the lengths in the graph
        backend = TritonBackend(static_max_len=self.max_blocks * self.block_size)
        self.backend = backend

        def step(inputs: DecodeInputs):
            size = inputs.size
            meta = AttentionMetadata(
                positions=inputs.positions, groups=[AttentionGroup(0, size, 1, None, None)],
                write_index=inputs.row_seq, write_slots=inputs.write_slots, uses_context=True, context_rows=size,
                has_prefill=False, writes_every_token=True, backend=backend, block_tables=inputs.block_tables,
                row_seq=inputs.row_seq, row_lens=inputs.row_lens)
            with forward_context(meta, runner.kv_caches, runner.parallel):
                states = runner.model(inputs.input_ids, meta.positions)
            return runner.model.compute_logits(states)

        self.graphs = DecodeGraphs(
            step, lambda size: DecodeInputs.allocate(size, self.max_blocks, self.scratch_block, self.block_size,
                                                     runner.device),
            capture_sizes(config.scheduler.max_num_seqs), api)

    def capture(self) -> bool:
        """Every size captured; False (logged) where the model cannot be captured: it then runs eagerly."""
        try:
            with torch.inference_mode():
                self.graphs.capture()
        except Exception as error:  # noqa: BLE001 - an op that cannot be captured (a host read in the model)
            logger.warning("kvshard: decode steps could not be captured as CUDA graphs (%s: %s): they run eagerly",
                           type(error).__name__, error)
            self.graphs.graphs.clear()
            return False
        return True

    @torch.inference_mode()  # the buffers were made under it, at capture
    def execute(self, plan: StepPlan) -> tuple[bool, torch.Tensor | None]:
        """(True, logits or None) where a graph ran the step; (False, None) where it must run eagerly."""
        n = len(plan.query_lens)
        if not is_plain_decode(plan) or self.graphs.size_for(n) is None:
            return False, None
        runner = self.runner
        if plan.tables is not None:  # the rank's persistent tables, the plan's changes applied (model_runner)
            if max(plan.tables.num_blocks) > self.max_blocks:
                return False, None
            meta = runner.metadata(plan.context_lens, plan.query_lens, slots=plan.tables.slots)
        else:  # a plan built by hand, with whole tables
            if max(len(table) for table in plan.block_tables) > self.max_blocks:
                return False, None
            meta = runner.metadata(plan.context_lens, plan.query_lens, plan.block_tables)
        input_ids = torch.tensor(plan.token_ids, dtype=torch.long, device=runner.device)
        logits = self.graphs.run(n, lambda inputs: inputs.load(input_ids, meta, self.block_size))
        return True, logits
