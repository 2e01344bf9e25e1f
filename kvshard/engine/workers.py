"""The other ranks: one process each, running whatever plan rank 0 broadcasts.

Locally, rank 0 lives in the caller's process and spawns ranks 1..N-1. Under
`torchrun` every rank is started by the launcher and ranks > 0 call
`run_worker` directly. A rank that dies is noticed by rank 0, which then stops
with a clear error instead of waiting on a collective forever.
"""

from __future__ import annotations

import multiprocessing
import socket
import traceback

import torch

from kvshard.config import EngineConfig
from kvshard.engine.model_runner import HEARTBEAT, ModelRunner, configure_cpu
from kvshard.parallel import broadcast_from_driver, exchange_heartbeat, init_parallel, shutdown_parallel


class RankDiedError(RuntimeError):
    """A rank process is gone; the engine cannot run another step."""


def pick_device(rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def run_worker(config: EngineConfig, rank: int, master: tuple[str, int]) -> None:
    """Body of every rank > 0: build the model shard, then run plans until told to stop."""
    configure_cpu(config.parallel.world_size)
    device = pick_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    state = init_parallel(config.parallel, rank, master, device)
    try:
        runner = ModelRunner(config, state, device)
        while True:
            plan = broadcast_from_driver(None, state)
            if plan is None:
                break
            if plan == HEARTBEAT:
                exchange_heartbeat(state)
            else:
                runner.execute(plan)
    finally:
        shutdown_parallel(state)


def _spawned_worker(config: EngineConfig, rank: int, master: tuple[str, int]) -> None:
    try:
        run_worker(config, rank, master)
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRanks:
    """Ranks 1..N-1 as child processes of rank 0 on this machine."""

    def __init__(self, config: EngineConfig) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # a spawned rank is re-importing the user's script, which starts an engine again
            raise RuntimeError(
                "kvshard starts its ranks with 'spawn', which imports your script again in each rank: "
                "create LLM (tensor_parallel_size > 1) under `if __name__ == \"__main__\":`"
            )
        self.master = ("127.0.0.1", free_port())
        context = multiprocessing.get_context("spawn")
        self.processes = {
            rank: context.Process(
                target=_spawned_worker, args=(config, rank, self.master), name=f"kvshard-rank{rank}", daemon=True
            )
            for rank in range(1, config.parallel.world_size)
        }
        for process in self.processes.values():
            process.start()

    def dead_ranks(self) -> dict[int, int | None]:
        return {rank: p.exitcode for rank, p in self.processes.items() if not p.is_alive()}

    def check_alive(self) -> None:
        dead = self.dead_ranks()
        if dead:
            raise RankDiedError(", ".join(f"rank {r} exited with code {c}" for r, c in sorted(dead.items())))

    def join(self, timeout: float) -> None:
        for process in self.processes.values():
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(1)
