"""The OpenMP wait settings ranks start with: a short spin by default, the user's own settings untouched; ranks
spawned from a script read from stdin."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvshard.engine.process_setup import OPENMP_SPIN_ROUNDS, openmp_defaults, rank_environment


def test_a_short_spin_is_the_default(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert openmp_defaults() == {"GOMP_SPINCOUNT": str(OPENMP_SPIN_ROUNDS)}
    with rank_environment():
        assert os.environ["GOMP_SPINCOUNT"] == str(OPENMP_SPIN_ROUNDS)
    assert "GOMP_SPINCOUNT" not in os.environ  # only while ranks are spawned


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                         ("GOMP_SPINCOUNT", "infinity")])
def test_a_user_wait_setting_gets_nothing_added(monkeypatch, name, value):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv(name, value)
    assert openmp_defaults() == {}  # GOMP_SPINCOUNT would override the user's OMP_WAIT_POLICY


def test_importing_kvshard_sets_the_spin_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = "import os, kvshard, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(OPENMP_SPIN_ROUNDS)


STDIN_SCRIPT = """
import __main__
from kvshard import LLM, SamplingParams
llm = LLM("kvshard-demo", tensor_parallel_size=2, max_model_len=128, kv_cache_memory="8MiB")
out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
print("tokens", len(out[0].outputs[0].token_ids), "main file", __main__.__file__)
"""


def test_a_script_read_from_stdin_spawns_its_ranks(tmp_path):
    """Before: `python - <<EOF` with tensor_parallel_size=2 failed as the spawned rank tried to run "<stdin>"."""
    out = subprocess.run([sys.executable, "-"], input=STDIN_SCRIPT, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "tokens 3 main file <stdin>"  # given back to the script after


def test_a_script_that_creates_its_llm_unguarded_is_told_so_by_rank_0(tmp_path):
    """A script that creates an LLM at tp > 1 at its top level, without `if __name__ == "__main__":`, has each
    spawned rank re-run it. Before: the error the script got was "rank 1 exited with code 1 while the ranks were
    connecting", the reason only in the rank's traceback above it; now rank 0's error says what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text('from kvshard import LLM\nLLM("kvshard-demo-gqa", tensor_parallel_size=2, max_model_len=128, '
                      'kv_cache_memory="4MiB")\n')
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("kvshard.engine.executor.RankDiedError: rank 1 exited with code 3") and \
        'under `if __name__ == "__main__":`' in last, out.stderr[-3000:]


# --- the building thread's OpenMP workers, handed back before the engine loop starts -----------------

POOL_SCRIPT = """
import os, threading, torch
from kvshard.engine.process_setup import release_openmp_threads
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
x = torch.randn(1024, 1024)
before = threads()
(x @ x).sum()  # a parallel region: this thread's pool gets its worker
with_pool = threads()
released = release_openmp_threads()
after = threads()
(x @ x).sum()  # a new region makes a new pool
print(before, with_pool, released, after, threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp's pool, as torch's Linux wheels load it")
def test_release_openmp_threads_hands_back_the_calling_threads_workers():
    """A thread that ran parallel regions keeps a pool of OpenMP workers; libgomp counts them against the cores and
    stops spinning in every other thread's team once they outnumber the cores (the server's engine loop, BENCHMARKS.md
    section 33). Released, the pool's worker exits; a later region makes a new one."""
    out = subprocess.run([sys.executable, "-c", POOL_SCRIPT], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    before, with_pool, released, after, again = out.stdout.split()
    assert released == "True", out.stdout
    assert int(with_pool) == int(before) + 1 and int(after) == int(before) and int(again) == int(before) + 1, out.stdout


def test_a_built_engine_hands_back_its_building_threads_workers(monkeypatch):
    """Whichever thread then steps it (the server's engine loop, the `LLM` API from a caller's worker thread),
    loading must not leave the building thread's OpenMP workers beside the stepping thread's: `LLMEngine` releases
    them once built, on the building thread."""
    import threading

    from kvshard.engine import llm_engine
    from kvshard.engine.arg_utils import EngineArgs

    calls = []
    monkeypatch.setattr(llm_engine, "release_openmp_threads", lambda: calls.append(threading.current_thread()) or True)
    config = EngineArgs.from_kwargs("kvshard-demo-gqa", max_model_len=64, kv_cache_memory="1MiB").create_engine_config()
    engine = llm_engine.LLMEngine(config)
    try:
        assert calls == [threading.current_thread()] and engine.scheduler is not None
    finally:
        engine.shutdown()
