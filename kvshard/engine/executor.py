"""Rank 0's hold on every rank: starts them, runs each step's plan on all, watches them, stops them.

Locally, rank 0 lives in the caller's process and spawns ranks 1..N-1. Under
`torchrun` every rank is started by the launcher and ranks > 0 run
`workers.run_worker`. Rank 0 sends each step's plan (and heartbeats, tasks,
the shutdown: kvshard/engine/rank_messages.py) and runs its own share of the
model; the others do the same on their shard.

A watchdog thread looks at the ranks from the moment they start (the rendezvous
and the model load included) while the engine runs, busy or idle, and ends the
engine with a reason that names the rank when
- a rank process exited;
- a rank's heartbeat (a counter its own thread ticks every
  $KVSHARD_HEARTBEAT_INTERVAL s: in shared memory for ranks spawned here, in
  the rendezvous store for ranks a launcher started) has not moved for
  $KVSHARD_HEARTBEAT_TIMEOUT s since its first tick: the process is stopped
  (SIGSTOP, a frozen VM); a rank spawned here that is stopped before its
  first tick is judged from when its process was first seen stopped;
- the idle engine's round trip through every rank (`heartbeat`) takes longer
  than that same deadline (the way to see ranks another launcher started);
- a step makes no progress for `step_timeout` seconds (a rank alive but stuck;
  long, since a long prefill may rightly take that long).
The first reason is the one kept: `dead_reason`.

Start-up ends with a round trip through every rank once each has built its model
(`_wait_until_ready`): a rank that failed to load or stopped ends the start-up
with an `EngineDeadError` naming it, before anything is served.
"""

from __future__ import annotations

import logging
import multiprocessing
import socket
import sys
import threading
import time

import torch

from kvshard.config import ConfigError, EngineConfig
from kvshard.engine.model_runner import ModelRunner
from kvshard.engine.process_setup import configure_process, pick_device, rank_environment
from kvshard.engine.rank_messages import HEARTBEAT, SHUTDOWN, send
from kvshard.engine.block_tables import BlockTableSender
from kvshard.engine.step_plan import StepPlan
from kvshard.engine.workers import spawned_worker
from kvshard.kv.cache import check_host_memory
from kvshard.shm import process_state
from kvshard import envs
from kvshard.envs import heartbeat_interval_s, heartbeat_timeout_s
from kvshard.parallel import (
    collective_timeout,
    exchange_heartbeat,
    heartbeat_key,
    init_parallel,
    shm_op_counters,
    shutdown_parallel,
    store_client,
)

logger = logging.getLogger("kvshard.engine")

# How often the watchdog looks at the ranks.
WATCH_INTERVAL_S = 0.1
# How often start-up's last round trip (`_wait_until_ready`) looks whether it is done: a Ctrl-C meanwhile is
# handled at once, also while a rank is still loading its model.
READY_POLL_S = 0.01
DEFAULT_STEP_TIMEOUT_S = envs.DEFAULT_STEP_TIMEOUT_S
# How `LocalRanks` starts ranks 1..N-1 (a multiprocessing start method): "spawn", a fresh interpreter that
# imports torch anew. The test suite sets "forkserver" with torch preloaded, so that its many short-lived
# engines start in a fraction of the time (tests/rank_start.py).
RANK_START_METHOD = "spawn"


class EngineDeadError(RuntimeError):
    """The engine cannot run another step (a rank died or hung, or a collective failed)."""


class RankDiedError(EngineDeadError):
    """A rank process is gone; the engine cannot run another step."""


def step_timeout_s() -> float:
    """Seconds a step may go without progress before its ranks count as hung ($KVSHARD_STEP_TIMEOUT)."""
    return envs.get("KVSHARD_STEP_TIMEOUT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank that started by re-importing the user's script found an LLM created at its top level
RERAN_SCRIPT = ("kvshard starts its ranks with 'spawn', which imports your script again in each rank: create LLM "
                "(tensor_parallel_size > 1) under `if __name__ == \"__main__\":`")
RERAN_SCRIPT_EXIT = 3


class LocalRanks:
    """Ranks 1..N-1 as child processes of rank 0 on this machine."""

    def __init__(self, config: EngineConfig) -> None:
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # a spawned rank is re-importing the user's script, which starts an engine again: said here, and by
            # the exit code to rank 0, whose error is the one the script's user reads
            print(f"kvshard: {RERAN_SCRIPT}", file=sys.stderr, flush=True)
            raise SystemExit(RERAN_SCRIPT_EXIT)
        self.master = ("127.0.0.1", free_port())
        context = multiprocessing.get_context(RANK_START_METHOD)
        # each rank's heartbeat counter, ticked by its own thread (workers.run_worker), read by the watchdog
        self.beats = context.RawArray("Q", config.parallel.world_size)
        # each rank's error, sent by workers.spawned_worker as it fails, read when its exit is reported
        self._errors = {rank: context.Pipe(duplex=False) for rank in range(1, config.parallel.world_size)}
        self._error_texts: dict[int, str] = {}
        self.processes = {
            rank: context.Process(
                target=spawned_worker, args=(config, rank, self.master, self.beats, self._errors[rank][1]),
                name=f"kvshard-rank{rank}", daemon=True,
            )
            for rank in range(1, config.parallel.world_size)
        }
        with rank_environment():
            for process in self.processes.values():
                process.start()
        for _, sender in self._errors.values():
            sender.close()  # the ranks hold their ends: a rank that exits without a word leaves its pipe empty

    def check_alive(self) -> None:
        dead = {rank: p.exitcode for rank, p in self.processes.items() if not p.is_alive()}
        if dead:
            raise RankDiedError(", ".join(self._exit_reason(r, c) for r, c in sorted(dead.items())))

    def _exit_reason(self, rank: int, code: int | None) -> str:
        """"rank R exited with code C", and the rank's own error where it sent one."""
        if rank not in self._error_texts:
            receiver = self._errors[rank][0]
            try:
                self._error_texts[rank] = receiver.recv() if receiver.poll() else ""
            except (EOFError, OSError):
                self._error_texts[rank] = ""
        error = self._error_texts[rank] or (RERAN_SCRIPT if code == RERAN_SCRIPT_EXIT else "")
        return f"rank {rank} exited with code {code}" + (f" ({error})" if error else "")

    def heartbeats(self) -> dict[int, int]:
        """{rank: counter} of the ranks that have ticked at least once, and 0 for one whose process is stopped
        (SIGSTOP) before its first tick. One still starting its interpreter (importing torch: seconds on a busy
        machine) has not ticked, and is left to the rendezvous deadline; a stopped one is told by its state."""
        return {rank: beat for rank, process in self.processes.items()
                if (beat := self.beats[rank]) or process_state(process.pid) in ("T", "t")}  # stopped

    def kill(self) -> None:
        for process in self.processes.values():
            if process.is_alive():
                process.kill()

    def join(self, timeout: float) -> None:
        for process in self.processes.values():
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(1)
        for receiver, _ in self._errors.values():
            receiver.close()


class StoreHeartbeats:
    """The heartbeat counters that ranks 1..N-1, started by a launcher, tick in the rendezvous store
    (workers.run_worker), read through a store connection of the watchdog's own, never waiting on a key."""

    def __init__(self, master: tuple[str, int], world_size: int, timeout_s: float) -> None:
        self.master, self.ranks, self.timeout_s = master, range(1, world_size), timeout_s
        self._store = None
        self._failing = False

    def read(self) -> dict[int, int] | None:
        """{rank: counter} (0 for a rank that has not ticked yet), or None while the store cannot be reached
        (said once per outage; the next call tries again)."""
        try:
            if self._store is None:
                self._store = store_client(self.master, self.timeout_s)
            beats = {rank: int(self._store.add(heartbeat_key(rank), 0)) for rank in self.ranks}
        except Exception as error:
            self._store = None
            if not self._failing:
                logger.warning("the ranks' heartbeats cannot be read from the rendezvous store at %s:%d (%s): "
                               "a stopped rank is left to the step timeout until it answers again",
                               self.master[0], self.master[1], error)
                self._failing = True
            return None
        self._failing = False
        return beats


def check_local_kv_memory(config: EngineConfig, master: tuple[str, int] | None) -> None:
    """Where every rank starts on this host and keeps its KV cache in host memory (no CUDA device), a ConfigError
    if their caches together take more than the memory available, before any rank starts (`kvshard serve` asks
    before it prints its start-up report)."""
    if master is None and pick_device(0).type == "cpu":
        world = config.parallel.world_size
        check_host_memory(config.num_kv_blocks * config.cache.block_size * config.kv_bytes_per_slot, world)


class Executor:
    def __init__(self, config: EngineConfig, master: tuple[str, int] | None = None) -> None:
        """Start every rank. `master` (host, port) is given when a launcher (torchrun) started the other ranks."""
        self.config = config
        self.step_timeout = step_timeout_s()
        self.heartbeat_timeout = heartbeat_timeout_s()
        if self.heartbeat_timeout < 2 * heartbeat_interval_s():
            raise ConfigError(f"KVSHARD_HEARTBEAT_TIMEOUT ({self.heartbeat_timeout:g} s) must be at least twice "
                              f"KVSHARD_HEARTBEAT_INTERVAL ({heartbeat_interval_s():g} s)")
        world = config.parallel.world_size
        self._dead_reason: str | None = None
        self._reason_lock = threading.Lock()
        self._closed = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._last_contact = time.monotonic()  # of the last plan every rank received
        self._busy_since: float | None = None  # start of the step (or heartbeat) in flight
        self._in_heartbeat = False  # whether what is in flight is the idle round trip (heartbeat_timeout)
        self.store_beats: StoreHeartbeats | None = None
        self.device = configure_process(0, world)
        check_local_kv_memory(config, master)
        self.local_ranks = LocalRanks(config) if world > 1 and master is None else None
        check_peers = None
        if self.local_ranks is not None:
            master, check_peers = self.local_ranks.master, self.local_ranks.check_alive
        if world > 1:
            # from now on: a rank stopped while the ranks connect or load their model is ended (and so
            # named) within the heartbeat's deadline, not left to the collective timeout of the wait on it
            self._watchdog = threading.Thread(target=self._watch, name="kvshard-rank-watchdog", daemon=True)
            self._watchdog.start()
        try:
            self.parallel = init_parallel(config.parallel, 0, master or ("", 0), self.device, check_peers)
        except BaseException as error:
            dead = self._failed_start_culprit(error)
            # ranks still connecting fail on their own (dropping the shared-memory names they made); a Ctrl-C or
            # SIGTERM has nothing to wait for
            self._abandon_start(kill=not isinstance(error, Exception))
            if dead is not None:  # say which rank, not just which socket broke
                raise RankDiedError(f"{dead} while the ranks were connecting") from error
            raise
        # ranks a launcher started tick their heartbeat in the rendezvous store
        if world > 1 and self.local_ranks is None:
            self.store_beats = StoreHeartbeats(master, world, self.heartbeat_timeout)
        # what every rank's block tables hold: each plan carries their changes (engine/block_tables.py)
        self.block_tables = BlockTableSender(check=envs.get("KVSHARD_CHECK_BLOCK_TABLES"))
        try:
            self.runner = ModelRunner(config, self.parallel, self.device)
            self._wait_until_ready()
        except BaseException as error:
            dead = self._failed_start_culprit(error)
            self._abandon_start(kill=True)
            shutdown_parallel(self.parallel)
            if dead is not None:
                raise RankDiedError(f"{dead} while the ranks loaded the model") from error
            raise

    def _abandon_start(self, kill: bool) -> None:
        """After a failed start-up: stop the watchdog and end the local ranks (`kill`: now, else once they have
        had a moment to fail on their own). None is sent the shutdown: a rank still loading its model, or one
        that did not finish start-up's round trip, never reads it, and rank 0's send would wait for it."""
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if self.local_ranks is not None:
            if kill:
                self.local_ranks.kill()
            self.local_ranks.join(timeout=5)

    def _failed_start_culprit(self, error: BaseException) -> str | None:
        """The rank a failed start-up is to be reported by (one that exited, with its own error, or that the
        watchdog ended), or None where rank 0's own error says it best: a setting refused here (every rank
        refuses it alike), a Ctrl-C, or an error while every rank is alive. Read before the ranks are joined."""
        if not isinstance(error, Exception) or (isinstance(error, ConfigError) and self._dead_reason is None):
            return None
        return self._name_dead_rank()

    def _wait_until_ready(self) -> None:
        """One round trip through every rank once each has built its model: a rank that failed to load it (and
        exited) or is stopped fails the start-up here, instead of a server that says it is healthy and fails
        its first request. Not a step: a rank still loading is waited for (up to the collective timeout)."""
        if self.parallel.world_size == 1:
            return
        try:
            send(HEARTBEAT, self.parallel)
            exchange_heartbeat(self.parallel, poll_s=READY_POLL_S)
        except Exception as error:  # a rank that exited is named by the caller; this says the rest
            timeout = collective_timeout().total_seconds()
            raise EngineDeadError(f"not every rank got ready, a rank loading its model being waited for up to "
                                  f"KVSHARD_COLLECTIVE_TIMEOUT_S={timeout:g} s: {error}") from error
        self._last_contact = time.monotonic()

    # --- steps --------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run the plan on every rank; float32 logits [len(sample_rows), V] of rank 0."""
        self.check_alive()
        return self._on_every_rank(lambda: self._broadcast_and_run(plan), "a collective failed")

    def _broadcast_and_run(self, plan: StepPlan) -> torch.Tensor | None:
        send(plan, self.parallel)
        return self.runner.execute(plan)

    def heartbeat(self, every_s: float = 1.0) -> None:
        """Send an empty plan to every rank (at most every `every_s`), so a rank that died while
        the engine idles is found now, also one that no local process handle can see."""
        if self.parallel.world_size == 1 or time.monotonic() - self._last_contact < every_s:
            return
        self.check_alive()

        def round_trip() -> None:
            send(HEARTBEAT, self.parallel)
            exchange_heartbeat(self.parallel)

        self._on_every_rank(round_trip, "a rank stopped answering", heartbeat=True)

    def _on_every_rank(self, work, failure: str, heartbeat: bool = False):
        self._in_heartbeat = heartbeat
        self._last_contact = self._busy_since = time.monotonic()
        try:
            return work()
        except Exception as error:
            raise EngineDeadError(self.record_death(self._name_dead_rank() or f"{failure}: {error}")) from error
        except BaseException as error:  # Ctrl-C in LLM.generate: the other ranks are left inside the step
            self._end(f"rank 0 was interrupted ({type(error).__name__}) in the middle of a step: the ranks are "
                      "out of step with it")
            raise
        finally:
            self._busy_since = None
            self._in_heartbeat = False

    # --- health -------------------------------------------------------------------------
    def record_death(self, reason: str) -> str:
        """Keep the first reason the engine died for; returns the one kept."""
        with self._reason_lock:
            if self._dead_reason is None:
                self._dead_reason = reason
            return self._dead_reason

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot step, or None while every rank is alive and answering."""
        if self._dead_reason is None and self.local_ranks is not None and not self._closed.is_set():
            try:
                self.local_ranks.check_alive()
            except RankDiedError as error:
                self.record_death(str(error))
        return self._dead_reason

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _watch(self) -> None:
        """Name a rank that exited, one whose heartbeat stopped, or one that makes no progress in a step for
        step_timeout (in the idle round trip: for heartbeat_timeout)."""
        progress, progress_time = None, 0.0
        beats: dict[int, int] = {}
        beat_times: dict[int, float] = {}
        while not self._closed.wait(WATCH_INTERVAL_S) and self.dead_reason is None:
            current = (self.local_ranks.heartbeats() if self.local_ranks is not None
                       else self.store_beats.read() if self.store_beats is not None else None)
            now = time.monotonic()  # after the read: a store read may take a moment
            if current is None:  # no counters (alone), or none readable now: judge afresh once they are
                beats.clear()
                beat_times.clear()
            else:
                for rank in [r for r in beat_times if r not in current]:  # a rank stopped before it ticked, resumed
                    del beats[rank], beat_times[rank]
                for rank, beat in current.items():
                    if beats.get(rank) != beat:
                        beats[rank], beat_times[rank] = beat, now
                stopped = [rank for rank, seen in sorted(beat_times.items()) if now - seen >= self.heartbeat_timeout]
                if stopped:
                    who = ", ".join(f"rank {r}" for r in stopped)
                    self._end(f"{who} stopped answering: no heartbeat for {self.heartbeat_timeout:g} s")
                    continue
            busy_since = self._busy_since
            if busy_since is None:
                continue
            counters = shm_op_counters(self.parallel)
            if counters != progress:  # a shared-memory collective moved on: the ranks are not hung
                progress, progress_time = counters, now
            timeout = self.heartbeat_timeout if self._in_heartbeat else self.step_timeout
            if now - max(progress_time, busy_since) < timeout or self._busy_since is None:
                continue
            behind = sorted({rank for ops in counters for rank, op in enumerate(ops) if op < max(ops)})
            who = ", ".join(f"rank {r}" for r in behind) or "a rank"
            if self._in_heartbeat:
                self._end(f"{who} did not answer the heartbeat within {timeout:g} s")
            else:
                self._end(f"{who} did not finish a step within {timeout:g} s")

    def _end(self, reason: str) -> None:
        self.record_death(reason)
        if self.local_ranks is not None:
            # the engine cannot continue: ending the ranks unblocks rank 0's collective at once
            self.local_ranks.kill()

    def _name_dead_rank(self, wait_s: float = 1.0) -> str | None:
        """A peer's death breaks the collective a moment before its process can be reaped: wait briefly to name it."""
        if self._dead_reason is not None:
            return self._dead_reason
        if self.local_ranks is None:
            return None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.local_ranks.check_alive()
            except RankDiedError as error:
                return str(error)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if self._dead_reason is None and self.parallel.world_size > 1:
            try:
                send(SHUTDOWN, self.parallel)
            except Exception:
                pass
        if self.local_ranks is not None:
            self.local_ranks.join(timeout=10)
        shutdown_parallel(self.parallel)
