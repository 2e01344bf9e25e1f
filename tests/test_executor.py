"""The executor's watch over the ranks: a rank that stops (SIGSTOP), busy or idle, ends the engine within
seconds through its heartbeat, naming the rank, and /health answers 503 at once; a rank that is alive but makes
no progress in a step ends it within the step timeout, instead of leaving requests hanging for the collective
timeout."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError
from kvshard.engine.executor import EngineDeadError, Executor, step_timeout_s
from kvshard.envs import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    heartbeat_interval_s,
    heartbeat_timeout_s,
)
from server_harness import MODEL, SERVE_ARGS, Server

STEP_TIMEOUT_S = 2  # far above a tiny model's step, short enough for the tests' waits
MARGIN_S = 8  # a loaded shared machine: the kill, the unwinding and the reply take a moment
HUNG = f"rank 1 did not finish a step within {STEP_TIMEOUT_S} s"
DETECTION_S = 5  # a stopped rank, busy or idle, is noticed within this, at the default settings
# the heartbeat's tick (idle or busy) or, idle, the engine's round trip through the ranks: whichever is first
STOPPED = re.compile(rf"rank 1 (stopped answering: no heartbeat for|did not answer the heartbeat within) "
                     rf"{DEFAULT_HEARTBEAT_TIMEOUT_S:g} s")
LLM_ARGS = dict(tensor_parallel_size=2, decode_context_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # the executor ended the hung rank
        pass


@pytest.fixture(scope="module", autouse=True)
def server_started(tmp_path_factory) -> Iterator[Future]:
    """The server test's server (default timeouts), started in the background as the module begins: the LLM
    tests run meanwhile."""
    log = tmp_path_factory.mktemp("serve") / "log"
    with ThreadPoolExecutor(1) as pool:
        # the defaults, named: the LLM tests meanwhile set other values in this process's environment
        defaults = {"KVSHARD_STEP_TIMEOUT": "30", "KVSHARD_HEARTBEAT_TIMEOUT": f"{DEFAULT_HEARTBEAT_TIMEOUT_S:g}",
                    "KVSHARD_HEARTBEAT_INTERVAL": f"{DEFAULT_HEARTBEAT_INTERVAL_S:g}"}
        start = pool.submit(Server, SERVE_ARGS, log, env=defaults)
        yield start
    if start.exception() is None:
        start.result().stop()


def test_a_stuck_rank_fails_the_llm_request_within_the_step_timeout(monkeypatch):
    """A rank whose heartbeat goes on but whose step does not (here: a stopped one, with the heartbeat's
    deadline out of reach) is caught by the step timeout."""
    monkeypatch.setenv("KVSHARD_STEP_TIMEOUT", str(STEP_TIMEOUT_S))
    monkeypatch.setenv("KVSHARD_HEARTBEAT_TIMEOUT", "600")
    llm = LLM(MODEL, **LLM_ARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].finish_reason == "length"
        rank1 = llm.engine.executor.local_ranks.processes[1].pid
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            with pytest.raises(EngineDeadError, match=HUNG):
                llm.generate(["Hello again"], params, use_tqdm=False)
            assert time.monotonic() - stopped_at < STEP_TIMEOUT_S + MARGIN_S
        finally:
            resume(rank1)
        assert llm.engine.dead_reason == HUNG
        with pytest.raises(EngineDeadError, match=HUNG):  # later requests are refused with the same reason
            llm.generate(["Hello"], params, use_tqdm=False)
    finally:
        closing = time.monotonic()
        llm.close()
        assert time.monotonic() - closing < 15, "shutting down after a hung rank hung itself"
    assert multiprocessing.active_children() == []


def test_a_rank_stopped_mid_generation_fails_the_llm_request_within_5_s(monkeypatch):
    """Busy: the step in flight waits on the stopped rank; its heartbeat, not the 30 s step timeout, ends it."""
    for name in ("KVSHARD_STEP_TIMEOUT", "KVSHARD_HEARTBEAT_TIMEOUT", "KVSHARD_HEARTBEAT_INTERVAL"):
        monkeypatch.delenv(name, raising=False)
    llm = LLM(MODEL, **LLM_ARGS)
    try:
        assert llm.engine.executor.step_timeout == 30
        params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
        rank1 = llm.engine.executor.local_ranks.processes[1].pid
        with ThreadPoolExecutor(1) as pool:
            first = llm.engine.steps
            running = pool.submit(llm.generate, ["Hello"] * 8, params, use_tqdm=False)
            deadline = time.monotonic() + 60
            while llm.engine.steps < first + 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert not running.done(), "the generation ended before its rank could be stopped"
            os.kill(rank1, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                with pytest.raises(EngineDeadError, match=STOPPED):
                    running.result(timeout=60)
                detected = time.monotonic() - stopped_at
            finally:
                resume(rank1)
        print(f"stopped rank, busy: the request failed after {detected:.2f} s")
        assert detected < DETECTION_S
        assert STOPPED.fullmatch(llm.engine.dead_reason)
    finally:
        closing = time.monotonic()
        llm.close()
        assert time.monotonic() - closing < 15, "shutting down after a stopped rank hung itself"
    assert multiprocessing.active_children() == []


def test_a_rank_stopped_while_the_server_idles_makes_health_503_within_5_s(server_started):
    server = server_started.result()
    try:
        client = server.client(timeout=60)
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].finish_reason
        (rank1,) = server.rank_pids()
        time.sleep(1.5)  # idle: no request in flight, the engine's round trip through the ranks due
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            deadline = stopped_at + DETECTION_S + MARGIN_S
            health = server.http.get("/health")
            while health.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
                health = server.http.get("/health")
            detected = time.monotonic() - stopped_at
            print(f"stopped rank, idle: /health 503 after {detected:.2f} s")
            assert health.status_code == 503 and STOPPED.search(health.json()["error"]["message"]), health.text
            assert detected < DETECTION_S
            refused = server.http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and STOPPED.search(refused.json()["error"]["message"])
        finally:
            resume(rank1)
    finally:
        code = server.stop()
    assert code == 1 and re.search(rf"the engine died: {STOPPED.pattern}", server.log)


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
@pytest.mark.parametrize("name, read", [("KVSHARD_STEP_TIMEOUT", step_timeout_s),
                                        ("KVSHARD_HEARTBEAT_TIMEOUT", heartbeat_timeout_s),
                                        ("KVSHARD_HEARTBEAT_INTERVAL", heartbeat_interval_s)])
def test_a_timeout_that_is_not_a_positive_number_is_refused(monkeypatch, value, name, read):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        read()


def test_a_heartbeat_deadline_within_two_ticks_is_refused(monkeypatch):
    monkeypatch.setenv("KVSHARD_HEARTBEAT_INTERVAL", "1")
    monkeypatch.setenv("KVSHARD_HEARTBEAT_TIMEOUT", "1.5")
    with pytest.raises(ConfigError, match="KVSHARD_HEARTBEAT_TIMEOUT .* at least twice KVSHARD_HEARTBEAT_INTERVAL"):
        Executor(None)


def test_the_store_heartbeat_says_once_that_the_store_is_gone_and_ticks_again_when_it_is_back(caplog):
    """Ranks a launcher started tick their heartbeat in the rendezvous store: a store that cannot be reached
    is logged once (per outage) on either side, never a dead thread; once it answers, the counter moves and
    rank 0's reader sees it."""
    import datetime
    import threading

    import torch.distributed as dist

    from kvshard.engine.executor import StoreHeartbeats, free_port
    from kvshard.engine.workers import _beat_through_store
    from kvshard.parallel import heartbeat_key

    master = ("127.0.0.1", free_port())  # nothing listens there yet
    reader = StoreHeartbeats(master, world_size=3, timeout_s=0.5)
    stopping = threading.Event()
    ticking = threading.Thread(target=_beat_through_store, args=(master, 2, 0.05, stopping), daemon=True)
    caplog.set_level("WARNING", logger="kvshard.engine")
    ticking.start()
    try:
        assert [reader.read() for _ in range(3)] == [None, None, None]
        deadline = time.monotonic() + 10  # the rank's thread has tried once (on a busy machine, not at once)
        while not any("rank 2: the heartbeat cannot reach" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the rank's thread never said that the store is gone"
            time.sleep(0.05)
        time.sleep(0.3)  # and several ticks more
        said = [r.getMessage() for r in caplog.records]
        assert sum("heartbeats cannot be read from the rendezvous store" in m for m in said) == 1, said
        assert sum("rank 2: the heartbeat cannot reach the rendezvous store" in m for m in said) == 1, said
        assert ticking.is_alive()
        store = dist.TCPStore(*master, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
        deadline = time.monotonic() + 10
        while int(store.add(heartbeat_key(2), 0)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        beats = reader.read()
        assert beats is not None and beats[1] == 0 and beats[2] >= 3, beats
        assert any("rank 2: the heartbeat reaches the rendezvous store again" in r.getMessage() for r in caplog.records)
    finally:
        stopping.set()
        ticking.join(5)
    assert not ticking.is_alive()


@pytest.mark.parametrize("first", ["collective", "heartbeat"])
def test_a_rank_says_once_that_it_stops_when_its_collective_and_its_heartbeat_both_find_rank_0_gone(
        first, monkeypatch, capsys):
    """Rank 0's end reaches a spawned rank two ways at once, its collective's PeerGoneError on the main thread and its
    heartbeat thread's check of rank 0's process: one line on stderr, whichever comes first (two lines appeared when
    both came within a tick)."""
    import threading

    from kvshard.engine import workers
    from kvshard.shm import PeerGoneError

    class Ended(Exception):
        pass

    class Gone:
        pid = 4242

        def is_alive(self):
            return False

    def collective_fails(*args, **kwargs):
        raise PeerGoneError("rank 0 of a shared-memory group (pid 4242) exited")

    def ended(code):
        raise Ended(code)

    monkeypatch.setattr(workers, "_stop_said", threading.Lock())  # as in a fresh rank's process
    monkeypatch.setattr(workers, "run_worker", collective_fails)
    monkeypatch.setattr(workers.signal, "signal", lambda *args: None)  # the rank ignores Ctrl-C: not this process
    monkeypatch.setattr(workers.os, "_exit", ended)

    def collective():
        with pytest.raises(SystemExit):
            workers.spawned_worker(None, 1, ("127.0.0.1", 0))

    def heartbeat():
        with pytest.raises(Ended):
            workers._beat({1: 0}, 1, 0.0, Gone())

    for path in (collective, heartbeat) if first == "collective" else (heartbeat, collective):
        path()
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    why = ("rank 0 of a shared-memory group (pid 4242) exited" if first == "collective"
           else "rank 0 (pid 4242) is gone")
    assert said == [f"kvshard: rank 1: {why}; this rank stops"], said
