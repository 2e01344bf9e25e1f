"""The ranks other than 0: one process each, running whatever plan rank 0 broadcasts.

Spawned by the executor on one machine (`spawned_worker`), or started by
`torchrun`, in which case ranks > 0 call `run_worker` directly.
"""

from __future__ import annotations

import threading
import time
import traceback

from kvshard.config import EngineConfig
from kvshard.engine.model_runner import ModelRunner
from kvshard.engine.process_setup import configure_process
from kvshard.engine.step_plan import HEARTBEAT
from kvshard.envs import heartbeat_interval_s
from kvshard.parallel import broadcast_from_driver, exchange_heartbeat, init_parallel, shutdown_parallel


def run_worker(config: EngineConfig, rank: int, master: tuple[str, int], beats=None) -> None:
    """Body of every rank > 0: build the model shard, then run plans until told to stop.

    `beats` (shared memory, one counter per rank; given by the executor that spawned this rank): this rank
    ticks its counter from a thread of its own, so rank 0 sees within a short deadline that the process
    stopped (SIGSTOP), whatever the step it is in, and however long that step may rightly take.
    """
    if beats is not None:
        threading.Thread(target=_beat, args=(beats, rank, heartbeat_interval_s()), name="kvshard-heartbeat",
                         daemon=True).start()
    device = configure_process(rank, config.parallel.world_size)
    state = init_parallel(config.parallel, rank, master, device)
    try:
        runner = ModelRunner(config, state, device)
        while True:
            plan = broadcast_from_driver(None, state)
            if plan is None:
                break
            if plan == HEARTBEAT:
                exchange_heartbeat(state)
            elif callable(getattr(plan, "run_on_rank", None)):  # e.g. a KV transfer (disagg/transfer.py)
                plan.run_on_rank(state, runner, device)
            else:
                runner.execute(plan)
    finally:
        shutdown_parallel(state)


def _beat(beats, rank: int, interval_s: float) -> None:
    while True:
        beats[rank] += 1  # only this rank writes its counter
        time.sleep(interval_s)


def spawned_worker(config: EngineConfig, rank: int, master: tuple[str, int], beats=None) -> None:
    try:
        run_worker(config, rank, master, beats)
    except Exception:
        traceback.print_exc()
        raise SystemExit(1)
