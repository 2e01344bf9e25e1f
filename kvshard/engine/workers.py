"""The ranks other than 0: one process each, running whatever plan rank 0 broadcasts.

Spawned by the executor on one machine (`spawned_worker`), or started by
`torchrun`, in which case ranks > 0 call `run_worker` directly.

A spawned rank lives only as long as rank 0: it ignores Ctrl-C (rank 0 alone
handles it and stops the ranks), its heartbeat thread ends the process once
rank 0's is gone (killed while the ranks start, when no collective is there to
notice), and an error that ends it is handed to rank 0, which reports the
rank's exit with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from kvshard.config import ConfigError, EngineConfig
from kvshard.engine.model_runner import ModelRunner
from kvshard.engine.process_setup import configure_process
from kvshard.engine.rank_messages import Heartbeat, RankMessage, Shutdown, receive
from kvshard.engine.step_plan import StepPlan
from kvshard.envs import heartbeat_interval_s, heartbeat_timeout_s
from kvshard.shm import PeerGoneError
from kvshard.parallel import (
    exchange_heartbeat,
    heartbeat_key,
    init_parallel,
    shutdown_parallel,
    store_client,
)

logger = logging.getLogger("kvshard.engine")

# Rank 0's end reaches a spawned rank two ways at once: the collective it waits in fails (PeerGoneError, on the main
# thread) and its heartbeat thread finds rank 0's process gone. Whichever comes first says so; the other keeps quiet.
_stop_said = threading.Lock()


def _say_this_rank_stops(rank: int, why: object) -> None:
    """One line on stderr that this rank stops and why, once per process."""
    if _stop_said.acquire(blocking=False):
        print(f"kvshard: rank {rank}: {why}; this rank stops", file=sys.stderr, flush=True)


# The longest error text a spawned rank hands rank 0 as it fails (rank 0 reports the rank's exit with it).
RANK_ERROR_CHARS = 500


def run_worker(config: EngineConfig, rank: int, master: tuple[str, int], beats=None) -> None:
    """Body of every rank > 0: build the model shard, then run plans until told to stop.

    A thread of this rank's own ticks its heartbeat counter, so rank 0 sees within a short deadline that the
    process stopped (SIGSTOP), whatever the step it is in, and however long that step may rightly take:
    `beats[rank]` (shared memory, one counter per rank) when the executor spawned this rank; without `beats`
    (a launcher such as torchrun started it) the key `heartbeat_key(rank)` of the rendezvous store, through a
    store connection of the thread's own.
    """
    if beats is not None:
        threading.Thread(target=_beat, args=(beats, rank, heartbeat_interval_s(), multiprocessing.parent_process()),
                         name="kvshard-heartbeat", daemon=True).start()
    device = configure_process(rank, config.parallel.world_size)
    state = init_parallel(config.parallel, rank, master, device)
    stopping = threading.Event()
    if beats is None and state.world_size > 1:  # the store is up now: every rank has joined it
        threading.Thread(target=_beat_through_store, args=(master, rank, heartbeat_interval_s(), stopping),
                         name="kvshard-heartbeat", daemon=True).start()
    try:
        runner = ModelRunner(config, state, device)
        while handle_message(receive(state), state, runner, device):
            pass
    finally:
        stopping.set()
        shutdown_parallel(state)


def handle_message(message: RankMessage, state, runner, device) -> bool:
    """Act on one of rank 0's messages (kvshard/engine/rank_messages.py); False once told to stop."""
    match message:
        case Shutdown():
            return False
        case Heartbeat():
            exchange_heartbeat(state)
        case StepPlan():
            runner.execute(message)
        case _:  # a RankTask (engine/kv_connector.py), e.g. a KV connector's share of a transfer
            message.run_on_rank(state, runner, device)
    return True


def _beat(beats, rank: int, interval_s: float, driver: multiprocessing.process.BaseProcess | None) -> None:
    """Tick `beats[rank]` every `interval_s`; end this process once `driver` (rank 0, which started it) is gone.
    Rank 0 may die while this rank loads its model or waits in a connection with no deadline of its own: it
    would stay on, alone, for the collective timeout or for ever."""
    while True:
        beats[rank] += 1  # only this rank writes its counter
        if driver is not None and not driver.is_alive():
            _say_this_rank_stops(rank, f"rank 0 (pid {driver.pid}) is gone")
            os._exit(1)  # the main thread may be blocked in a C call: nothing else ends the process for sure
        time.sleep(interval_s)


def _beat_through_store(master: tuple[str, int], rank: int, interval_s: float, stopping: threading.Event) -> None:
    """Tick `heartbeat_key(rank)` in the rendezvous store every `interval_s` until `stopping` is set. A store
    that cannot be reached (rank 0's, or the launcher's, gone) is said once per outage, and tried again at
    every tick."""
    key, store, failing = heartbeat_key(rank), None, False
    timeout_s = heartbeat_timeout_s()
    while not stopping.is_set():
        try:
            if store is None:
                store = store_client(master, timeout_s)
            store.add(key, 1)
            if failing:
                logger.warning("rank %d: the heartbeat reaches the rendezvous store again", rank)
                failing = False
        except Exception as error:  # the thread goes on: the store may come back
            store = None
            if not failing:
                logger.warning("rank %d: the heartbeat cannot reach the rendezvous store at %s:%d (%s); "
                               "trying again every %g s", rank, master[0], master[1], error, interval_s)
                failing = True
        stopping.wait(interval_s)


def spawned_worker(config: EngineConfig, rank: int, master: tuple[str, int], beats=None,
                   errors: Connection | None = None) -> None:
    """A rank the executor spawned (executor.LocalRanks). `errors`: where the error that ends it goes, for rank 0
    to report (a refused setting, which rank 0 reports in one line, prints no traceback here)."""
    # Ctrl-C reaches every process of the terminal's process group: rank 0 alone handles it and stops this rank
    # (a rank that died of it would turn a clean stop into "rank 1 exited with code 1")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_worker(config, rank, master, beats)
    except PeerGoneError as error:
        # another rank's process ended in the middle of a collective: rank 0 (killed, or a server stopped) or a
        # rank whose own error rank 0 reports. Not this rank's fault: one line, not a traceback of its wait
        _say_this_rank_stops(rank, error)
        _hand_over(errors, error)
        raise SystemExit(1)
    except Exception as error:
        if not isinstance(error, ConfigError):
            traceback.print_exc()
        _hand_over(errors, error)
        raise SystemExit(1)


def _hand_over(errors: Connection | None, error: Exception) -> None:
    """Send rank 0 this rank's error in one line (never raising: rank 0 may be gone already)."""
    if errors is None:
        return
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    try:
        errors.send(text[:RANK_ERROR_CHARS])
    except OSError:
        pass
