"""Where a DCP step's attention time goes, per rank: collectives, local attention, merge.

Each rank's `Attention` layers add wall time (time.perf_counter, no device sync) to this
process's `DCP_TIMES` and count the merge scheme each layer took. Every
`KVSHARD_DCP_TIMING_EVERY` steps (default 16; 0 turns the timers off) the ranks all-gather
their totals, so rank 0 knows every rank's figures without a collective in the other steps.
On a GPU the figures are host time of launches unless a collective waits on its peers:
collective time then includes waiting for the slowest rank, which is the point.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvshard import envs
from kvshard.parallel import ParallelState, tp_all_gather_last_dim

TIMING_EVERY = envs.env("KVSHARD_DCP_TIMING_EVERY").default  # 16
PHASES = ("collective", "attention", "merge")  # DCP collectives, local attention, local merge arithmetic


@dataclass
class DcpTimes:
    """This rank's running totals in seconds, and merges by scheme (see backend.merge_scheme)."""

    enabled: bool = True
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    merges: Counter = field(default_factory=Counter)

    def add(self, phase: str, since: float) -> float:
        """Add the time since `since` to `phase`; returns now, the start of the next phase."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now


DCP_TIMES = DcpTimes()


@dataclass(frozen=True)
class DcpTimingReport:
    """Every rank's totals at the last gather (rank 0's view): seconds[rank][phase], over `steps` steps."""

    steps: int
    seconds: list[dict[str, float]]
    merges: dict[str, int]  # rank 0's merges by scheme, up to now

    def per_step(self, phase: str) -> list[float]:
        """Mean seconds per step in `phase`, per rank."""
        return [s[phase] / self.steps if self.steps else 0.0 for s in self.seconds]

    def since(self, earlier: DcpTimingReport | None) -> DcpTimingReport:
        """The steps and seconds after `earlier` (a report of the same engine)."""
        if earlier is None:
            return self
        return DcpTimingReport(
            self.steps - earlier.steps,
            [{p: now[p] - then[p] for p in PHASES} for now, then in zip(self.seconds, earlier.seconds)],
            {k: n - earlier.merges.get(k, 0) for k, n in self.merges.items()})

    def summary(self) -> str:
        """Milliseconds per step: rank 0 and the slowest rank, per phase."""
        parts = []
        for phase in PHASES:
            per_rank = self.per_step(phase)
            parts.append(f"{phase} {per_rank[0] * 1e3:.2f} ms (slowest rank {max(per_rank) * 1e3:.2f})")
        merges = ", ".join(f"{k} x{n}" for k, n in sorted(self.merges.items()) if n)
        return f"DCP per step over {self.steps} steps: " + "; ".join(parts) + f"; merges: {merges or 'none'}"


class DcpTimingGather:
    """Called once per step on every rank (the same steps everywhere, so the gathers match)."""

    def __init__(self, parallel: ParallelState) -> None:
        self.parallel = parallel
        self.every = envs.get("KVSHARD_DCP_TIMING_EVERY") if parallel.dcp_size > 1 else 0
        DCP_TIMES.enabled = self.every > 0
        DCP_TIMES.seconds = dict.fromkeys(PHASES, 0.0)  # a new engine in this process starts from zero
        DCP_TIMES.merges.clear()
        self.steps = 0
        self.report: DcpTimingReport | None = None

    def after_step(self) -> None:
        if not self.every:
            return
        self.steps += 1
        if self.steps % self.every:
            return
        mine = torch.tensor([DCP_TIMES.seconds[p] for p in PHASES], dtype=torch.float64)
        gathered = tp_all_gather_last_dim(mine, self.parallel).view(-1, len(PHASES))  # [tp, phases]
        self.report = DcpTimingReport(self.steps, [dict(zip(PHASES, row.tolist())) for row in gathered],
                                      dict(DCP_TIMES.merges))
