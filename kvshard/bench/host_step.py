"""Host time of one decode step, without a model: rank 0's planning, the plan's serialisation, and a
rank's attention metadata, at a given number of running requests and context length.

`python -m kvshard.bench.host_step --requests 64 --contexts 1024,32768` drives the real scheduler,
step plan and metadata code over a block pool large enough for every context (no KV cache is
allocated: the metadata addresses blocks, it reads none). Each timed step: `Scheduler.schedule`,
the plan built (`StepRows`, `StepPlan` with the block tables' changes), pickled and unpickled as the
broadcast to the other ranks does, and the rank's work on it (the changes applied to its persistent
block tables, its attention metadata built); then a token is appended to every request, as if
sampled (not timed). The figures are medians over the steps; the time per step should not grow with
the context (docs/design.md#ranks-and-steps). The contexts take turns, five steps at a time.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time

import torch

from kvshard.attention.backends import ReferenceBackend
from kvshard.attention.metadata import AttentionMetadata
from kvshard.bench.cli import _positive_ints
from kvshard.config import SchedulerConfig
from kvshard.engine.block_tables import BlockTableSender, RankBlockTables
from kvshard.engine.scheduler import Scheduler
from kvshard.engine.sequence import Sequence
from kvshard.engine.step_plan import StepPlan, StepRows
from kvshard.kv.block_pool import BlockPool
from kvshard.kv.layout import DCPLayout
from kvshard.sampling_params import SamplingParams

PHASES = ("schedule", "plan", "serialise", "metadata")
CPU = torch.device("cpu")


def _decoding(num_requests: int, context: int, layout: DCPLayout, seed: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler whose `num_requests` requests have `context` tokens each in the cache and decode."""
    per_request = layout.num_virtual_blocks(context + 1024)
    pool = BlockPool(num_requests * per_request + 64)
    budget = num_requests * (context + 1)
    config = SchedulerConfig(max_num_seqs=num_requests, max_num_batched_tokens=budget, max_model_len=context + 4096)
    scheduler = Scheduler(config, pool, layout, enable_prefix_caching=False)
    generator = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(num_requests):
        prompt = torch.randint(0, 30000, (context,), generator=generator).tolist()
        seq = Sequence(f"r{i}", 0, prompt, SamplingParams(max_tokens=None), None)
        scheduler.add(seq)
        seqs.append(seq)
    while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in seqs):  # prefill, without a model
        batch = scheduler.schedule()
        scheduler.mark_computed(batch)
        for seq, do_sample in zip(batch.seqs, batch.sample):
            if do_sample:
                seq.output_token_ids.append(1)
    return scheduler, seqs


class _Run:
    """One context's decoding requests, and the times of its steps so far."""

    def __init__(self, num_requests: int, context: int, block_size: int, dcp: int, seed: int) -> None:
        self.num_requests, self.context, self.dcp, self.block_size = num_requests, context, dcp, block_size
        self.layout = DCPLayout(block_size, dcp, 1)
        self.scheduler, _ = _decoding(num_requests, context, self.layout, seed)
        self.backend = ReferenceBackend()  # the metadata of the paged and Triton backends: the same (causal_rows)
        # rank 0's view of the tables, and a rank's (engine/block_tables.py)
        self.sender, self.tables = BlockTableSender(), RankBlockTables(CPU, num_requests)
        self.times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.plan_bytes = 0

    def steps(self, count: int) -> None:
        for _ in range(count):
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            t1 = time.perf_counter()
            rows = StepRows.from_batch(batch)
            plan = StepPlan.from_batch(batch, rows, tables=self.sender.changes(batch.seqs))
            t2 = time.perf_counter()
            wire = pickle.dumps(plan)
            received = pickle.loads(wire)
            t3 = time.perf_counter()
            self.tables.apply(received.tables)  # as ModelRunner.execute does
            AttentionMetadata.build(received.context_lens, received.query_lens, self.tables.table, self.layout, 0,
                                    CPU, backend=self.backend, table_rows=received.tables.slots)
            t4 = time.perf_counter()
            assert batch.query_lens == [1] * self.num_requests, "every request decodes"
            self.scheduler.mark_computed(batch)
            for seq in batch.seqs:
                seq.output_token_ids.append(1)
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                self.times[phase].append(seconds)
            self.plan_bytes = len(wire)

    def result(self) -> dict:
        medians = {phase: statistics.median(values) for phase, values in self.times.items()}
        return {"requests": self.num_requests, "context": self.context, "steps": len(self.times["schedule"]),
                "dcp": self.dcp, "block_size": self.block_size, "plan_bytes": self.plan_bytes,
                "ms": {p: round(s * 1e3, 4) for p, s in medians.items()},
                "total_ms": round(sum(medians.values()) * 1e3, 4)}


def measure(num_requests: int, context: int, steps: int, block_size: int = 16, dcp: int = 1,
            seed: int = 0) -> dict:
    """Median milliseconds per phase of a decode step, and the pickled plan's size."""
    run = _Run(num_requests, context, block_size, dcp, seed)
    run.steps(steps)
    return run.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvshard.bench.host_step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="running decode requests (default 64)")
    parser.add_argument("--contexts", type=_positive_ints, default=[1024, 32768],
                        help="context lengths in tokens, comma-separated (default 1024,32768)")
    parser.add_argument("--steps", type=int, default=50, help="timed decode steps per context (default 50), the contexts taking turns")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dcp", type=int, default=1, help="DCP group size: metadata of rank 0 of the group")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: the step's host work is serial; on a busy machine more "
                             "threads only add waits to its small tensor operations)")
    parser.add_argument("--json", action="store_true", help="one JSON object per context")
    args = parser.parse_args(argv)
    if min(args.requests, args.steps, args.block_size, args.dcp, args.threads) < 1:
        parser.error("--requests, --steps, --block-size, --dcp and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    # the contexts take turns, a few steps at a time, so that a busy machine's load falls on each alike
    runs = [_Run(args.requests, context, args.block_size, args.dcp, 0) for context in args.contexts]
    per_turn = 5
    for _ in range(-(-args.steps // per_turn)):
        for run in runs:
            run.steps(per_turn)
    results = [run.result() for run in runs]
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            phases = "  ".join(f"{p} {result['ms'][p]:.3f}" for p in PHASES)
            print(f"{args.requests} requests x {result['context']} tokens: {result['total_ms']:.3f} ms/step "
                  f"({phases} ms), plan {result['plan_bytes']} bytes")
    if len(results) > 1 and not args.json:
        first, last = results[0]["total_ms"], results[-1]["total_ms"]
        print(f"longest / shortest context: {last / first:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
