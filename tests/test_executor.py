"""The executor's watch over the ranks: a rank that is alive but stops answering ends the engine within
the step timeout, naming the rank, instead of leaving requests hanging for the collective timeout."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import openai
import pytest

from kvshard import LLM, SamplingParams
from kvshard.config import ConfigError
from kvshard.engine.executor import EngineDeadError, step_timeout_s
from server_harness import MODEL, SERVE_ARGS, Server

STEP_TIMEOUT_S = 2  # far above a tiny model's step, short enough for the tests' waits
MARGIN_S = 8  # a loaded shared machine: the kill, the unwinding and the reply take a moment
HUNG = f"rank 1 did not finish a step within {STEP_TIMEOUT_S} s"


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # the executor ended the hung rank
        pass


@pytest.fixture(scope="module", autouse=True)
def server_started(tmp_path_factory) -> Iterator[Future]:
    """The server test's server, started in the background as the module begins: most of the LLM test is a wait
    on the step timeout."""
    log = tmp_path_factory.mktemp("serve") / "log"
    with ThreadPoolExecutor(1) as pool:
        start = pool.submit(Server, SERVE_ARGS, log, env={"KVSHARD_STEP_TIMEOUT": str(STEP_TIMEOUT_S)})
        yield start
    if start.exception() is None:
        start.result().stop()


def test_a_stopped_rank_fails_the_llm_request_within_the_step_timeout(monkeypatch):
    monkeypatch.setenv("KVSHARD_STEP_TIMEOUT", str(STEP_TIMEOUT_S))
    llm = LLM(MODEL, tensor_parallel_size=2, decode_context_parallel_size=2, max_model_len=256,
              kv_cache_memory="16MiB")
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


def test_a_stopped_rank_makes_the_server_answer_503_within_the_step_timeout(server_started):
    server = server_started.result()
    try:
        client = server.client(timeout=60)
        stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        (rank1,) = server.rank_pids()
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            with pytest.raises(openai.APIError, match=HUNG):
                for _ in stream:
                    pass
            health = server.http.get("/health")
            assert health.status_code == 503 and HUNG in health.json()["error"]["message"]
            assert time.monotonic() - stopped_at < STEP_TIMEOUT_S + MARGIN_S
        finally:
            resume(rank1)
    finally:
        code = server.stop()
    assert code == 1 and f"the engine died: {HUNG}" in server.log


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_step_timeout_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv("KVSHARD_STEP_TIMEOUT", value)
    with pytest.raises(ConfigError, match="KVSHARD_STEP_TIMEOUT"):
        step_timeout_s()
