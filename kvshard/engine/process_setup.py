"""How a rank process sets itself up before it builds its model shard: device, threads, memory.

Every rank calls `configure_process` first thing. The OpenMP runtime that torch
uses (libgomp) reads its environment once, when torch is loaded: the settings
it needs are therefore put into the environment of the spawned ranks by
`rank_environment` before they start, and into rank 0's by `import kvshard`
(which runs `apply_openmp_defaults` before anything loads torch). That is also
why this module imports torch only inside its functions.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvshard import envs

if TYPE_CHECKING:
    import torch


def pick_device(rank: int) -> torch.device:
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def configure_process(rank: int, world_size: int) -> torch.device:
    """Threads and memory of this rank; returns (and selects) its device."""
    import torch

    configure_threads(world_size)
    keep_freed_memory()
    device = pick_device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def configure_threads(world_size: int) -> None:
    """Ranks on one CPU machine share its cores instead of each taking all of them."""
    import torch

    threads = envs.get("KVSHARD_NUM_THREADS")
    torch.set_num_threads(threads if threads is not None else max(1, (os.cpu_count() or 1) // world_size))


# libgomp's spin before a waiting thread sleeps, in rounds of a pause instruction: long enough to bridge
# the gap between two operators of a step (measured: 10,000 rounds keep nothing of the spin's gain,
# 100,000 keep all of OMP_WAIT_POLICY=ACTIVE's), a third of libgomp's own default of 300,000, so that a
# thread whose partner was descheduled by another program gives up its core sooner (BENCHMARKS.md,
# "Threads on a shared machine"). OMP_WAIT_POLICY=PASSIVE is 0.
OPENMP_SPIN_ROUNDS = 100_000
_USER_OPENMP_WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def openmp_defaults() -> dict[str, str]:
    """OpenMP settings for a machine whose cores other programs may be using.

    At every barrier of a parallel region a thread waits for its partner threads, spinning
    (libgomp: up to 300,000 rounds, milliseconds) or asleep (OMP_WAIT_POLICY=PASSIVE). Asleep
    costs a quiet machine a wake-up at every operator: 14-23% of the throughput (BENCHMARKS.md,
    "Threads on a shared machine"). Spinning costs a busy one: a thread whose partner was
    descheduled by another program burns its own time slice for nothing. A third of libgomp's
    spin keeps the quiet machine's speed and bounds the waste. On a machine shared with other
    work, OMP_WAIT_POLICY=PASSIVE is the setting to use. A user who sets either OMP_WAIT_POLICY
    or GOMP_SPINCOUNT keeps their setting, and gets nothing added.
    """
    if any(name in os.environ for name in _USER_OPENMP_WAIT_SETTINGS):
        return {}
    return {"GOMP_SPINCOUNT": str(OPENMP_SPIN_ROUNDS)}


def apply_openmp_defaults() -> None:
    """Put the OpenMP defaults into this process's environment (effective only before torch is loaded:
    a program that imports torch before kvshard keeps OpenMP's own defaults in rank 0)."""
    for name, value in openmp_defaults().items():
        os.environ.setdefault(name, value)


@contextmanager
def rank_environment() -> Iterator[None]:
    """While ranks are spawned: they inherit the OpenMP defaults (a spawned process imports torch anew), and
    Ctrl-C ignored. Ctrl-C reaches every process of the terminal's group, and rank 0 alone handles it (it stops
    the ranks); an ignored signal stays ignored across exec, so a rank still importing torch does not die of it
    with a traceback either. Only the main thread can change a signal's handler: elsewhere the ranks take it
    from their first line on (workers.spawned_worker)."""
    added = {name: value for name, value in openmp_defaults().items() if name not in os.environ}
    os.environ.update(added)
    ctrl_c = (signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread()
              else None)
    main, main_file = _main_without_a_file()
    try:
        yield
    finally:
        if ctrl_c is not None:  # first: a signal's KeyboardInterrupt during the rest must not leave Ctrl-C ignored
            signal.signal(signal.SIGINT, ctrl_c)
        if main_file is not None:
            main.__file__ = main_file
        for name in added:
            os.environ.pop(name, None)


def _main_without_a_file():
    """A script read from stdin (`python - <<EOF`) names its `__main__` file "<stdin>", which a spawned process
    would try to run again, and fail on before it starts the rank. The ranks need nothing of the caller's script:
    while they are spawned, such a name (one that is not a file) is hidden. Returns (module, the name hidden)."""
    main = sys.modules.get("__main__")
    name = getattr(main, "__file__", None)
    if main is None or name is None or getattr(main, "__spec__", None) is not None or os.path.isfile(name):
        return main, None
    del main.__file__
    return main, name


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the runtime's threads, keep its settings


def release_openmp_threads() -> bool:
    """Hand back the OpenMP worker threads of the calling thread (libgomp's thread pool of this thread's
    parallel regions), so that the thread that steps an engine built here is the only one whose team the runtime
    counts (`LLMEngine` calls it once built).

    libgomp spins at a barrier only while the threads it manages are no more than the cores; past them it
    spins 1,000 rounds and sleeps. The server builds the engine on its main thread (whose parallel regions leave a
    pool of workers behind) and steps it on the engine-loop thread (which gets a pool of its own): on a 2-core
    machine 4 managed threads, every operator of every step waking its partner from sleep. Measured on 2 cores,
    bfloat16 products of 64 rows ran 3.3x slower on such a second thread, and the GQA demo's trace replay took 1.6x
    the step time served than in one thread (BENCHMARKS.md section 33). `omp_pause_resource_all` (OpenMP 5.0)
    frees the calling thread's pool; a later parallel region of that thread makes a new one. Returns whether the
    runtime freed it: False where torch's OpenMP is not libgomp, or not loaded, or not on Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and line.rstrip().endswith(".so.1")}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(_OMP_PAUSE_SOFT) == 0
    return False


def keep_freed_memory() -> None:
    """Stop glibc from handing freed memory back to the kernel between steps.

    A step allocates and frees the same multi-MB activations every time; by default glibc serves
    each from fresh mmap'd pages and returns them on free, so every step pays page faults and
    zeroing for memory it just had (measured: a third of a KV gather's time). With these settings
    the process keeps its high-water mark instead. glibc only; elsewhere, or with
    KVSHARD_KEEP_FREED_MEMORY=0, nothing changes.
    """
    if not envs.get("KVSHARD_KEEP_FREED_MEMORY") or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        pass
