"""How the suite starts an engine's ranks 1..N-1: forked from a server process that has imported torch once.

Each rank started with 'spawn' (kvshard's default, `executor.RANK_START_METHOD`) imports torch anew: seconds
of CPU per rank, most of a tiny engine's start-up, times a few hundred ranks per run of the suite. A
forkserver child starts with torch already loaded. It is forked from the server, though, so it would see the
environment the server started with, not the one the tests set around an engine (`conftest.environment`):
`RankTarget` stands in for the ranks' target and carries the caller's `os.environ` of the moment the rank is
started, which the child puts back before it runs anything of kvshard. kvshard's rank and server modules are
imported in the forkserver too: none reads a setting when it is imported (tests/test_settings.py checks it);
so are the parts of transformers a server reads a checkpoint with (no test sets transformers' own variables).
The suite's servers fork from the same forkserver (server_harness.ForkedServer).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import sys
from multiprocessing import forkserver, resource_tracker
from pathlib import Path

# what a rank and a server import (kvshard's modules read settings when they run, in the rank, never on import);
# then what a server imports of transformers to read a checkpoint's config and tokenizer (kvshard/config/model_dir.py,
# engine/llm_engine.py): seconds per server start otherwise. The forkserver skips a name its transformers lacks.
PRELOAD = ["torch", "kvshard.engine.workers", "kvshard.entrypoints.cli", "kvshard.entrypoints.serve",
           "kvshard.entrypoints.openai_server",
           "transformers", "transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto",
           *(f"transformers.models.{name}.configuration_{name}" for name in ("llama", "deepseek_v2", "deepseek_v3"))]
# Set in a server's environment (server_harness.ForkedServer): a folder where each of its ranks leaves its pid.
RANK_PIDS_DIR = "SUITE_RANK_PIDS_DIR"


def _in_environment(environ: dict[str, str]) -> RankTarget:
    """Unpickled in the rank before the rank's arguments (the engine config, which imports kvshard)."""
    os.environ.clear()
    os.environ.update(environ)
    return RankTarget()


class RankTarget:
    """`kvshard.engine.workers.spawned_worker`, started in the caller's environment."""

    def __reduce__(self):
        return _in_environment, (dict(os.environ),)

    def __call__(self, *args) -> None:
        from kvshard.engine.workers import spawned_worker

        if os.environ.get(RANK_PIDS_DIR):
            Path(os.environ[RANK_PIDS_DIR], str(os.getpid())).touch()
            name_this_process("kvshard-rank")  # a forked server's rank

        spawned_worker(*args)


def use_forkserver() -> None:
    """Start the server now (in the session's own environment) and have every LocalRanks use it."""
    from kvshard.engine import executor

    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    executor.RANK_START_METHOD = "forkserver"
    executor.spawned_worker = RankTarget()


def ranks_from_this_forkserver() -> None:
    """In a process the forkserver started (a server of the suite's, server_harness.ForkedServer): its LocalRanks
    fork from the same forkserver. Such a child knows the forkserver's address and holds its alive-pipe, but
    not its pid, from which `ensure_running` would conclude there is none and start another."""
    from kvshard.engine import executor

    forkserver._forkserver.ensure_running = resource_tracker.ensure_running
    executor.RANK_START_METHOD = "forkserver"
    executor.spawned_worker = RankTarget()


def name_this_process(name: str) -> None:
    """The name `ps -o comm` and `pgrep NAME` show (Linux's PR_SET_NAME; elsewhere nothing): a process forked from
    the forkserver has the forkserver's command line."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(15, name.encode()[:15])  # PR_SET_NAME = 15
