"""A rank that stops, fails or loses rank 0 while the ranks start; Ctrl-C reaching every rank; a server stopped
with streams open; what the log and /metrics say once a rank died. Nothing hangs, nothing is left behind, and
each error names the rank (tests/test_executor.py and tests/test_server_errors.py cover a rank lost once the
engine runs).

Rank 1 is made to misbehave at a chosen point of its own start-up by `RankThat`, which stands in for the ranks'
target (the suite's rank_start.RankTarget) and replaces one name of kvshard/engine/workers.py in rank 1 alone."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshard import LLM, SamplingParams
from kvshard.engine import executor
from kvshard.engine.executor import EngineDeadError
from server_harness import MODEL, SERVE_ARGS, Server

LLM_ARGS = dict(tensor_parallel_size=2, decode_context_parallel_size=2, max_model_len=256, kv_cache_memory="16MiB")
HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 3
# what a wait on a rank falls back to without the watchdog: far above the deadlines checked here
COLLECTIVE_TIMEOUT_S = 40
DEADLINES = {"KVSHARD_HEARTBEAT_INTERVAL": f"{HEARTBEAT_INTERVAL_S:g}",
             "KVSHARD_HEARTBEAT_TIMEOUT": f"{HEARTBEAT_TIMEOUT_S:g}",
             "KVSHARD_COLLECTIVE_TIMEOUT_S": f"{COLLECTIVE_TIMEOUT_S:g}"}
MARGIN_S = 8  # a loaded shared machine: starting the engine, the kill and the unwinding take a moment
STOPPED = f"rank 1 stopped answering: no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s"


class RankThat:
    """The ranks' target, with rank 1 doing `what` ("stops": SIGSTOP to itself; "fails": raises OSError; "hangs":
    sleeps for an hour) where it "connects" (`init_parallel`) or "loads" its model (`ModelRunner`), after its
    heartbeat has ticked, or (only "stops") as it "starts", before its heartbeat thread exists; just before,
    `pid_file` gets its pid. Picklable: the rank runs it."""

    def __init__(self, target, where: str, what: str, pid_file: str | None = None) -> None:
        self.target, self.where, self.what, self.pid_file = target, where, what, pid_file

    def __call__(self, config, rank: int, *rest) -> None:
        if rank == 1 and self.where == "starts":  # before its heartbeat thread exists: it never ticks
            if self.pid_file is not None:
                Path(self.pid_file).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        elif rank == 1:
            from kvshard.engine import workers

            name = {"connects": "init_parallel", "loads": "ModelRunner"}[self.where]
            original = getattr(workers, name)

            def misbehaving(*args, **kwargs):
                time.sleep(2 * HEARTBEAT_INTERVAL_S)  # the heartbeat has ticked: the watchdog judges this rank
                if self.pid_file is not None:  # its time: when the rank began to misbehave
                    Path(self.pid_file).write_text(str(os.getpid()))
                if self.what == "stops":
                    os.kill(os.getpid(), signal.SIGSTOP)
                elif self.what == "fails":
                    raise OSError("the checkpoint's shard cannot be read")
                elif self.what == "hangs":
                    time.sleep(3600)
                return original(*args, **kwargs)

            setattr(workers, name, misbehaving)
        self.target(config, rank, *rest)


@pytest.fixture
def rank_that(monkeypatch):
    """rank_that(where, what, pid_file=None): the next engine's rank 1 misbehaves (`RankThat`); the deadlines
    of `DEADLINES` are set."""
    for name, value in DEADLINES.items():
        monkeypatch.setenv(name, value)

    def make(where: str, what: str, pid_file: str | None = None) -> None:
        monkeypatch.setattr(executor, "spawned_worker", RankThat(executor.spawned_worker, where, what, pid_file))

    return make


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("where, when", [("starts", "while the ranks were connecting"),
                                         ("connects", "while the ranks were connecting"),
                                         ("loads", "while the ranks loaded the model")])
def test_a_rank_stopped_while_the_ranks_start_fails_the_start_within_the_heartbeat_deadline(rank_that, tmp_path,
                                                                                             where, when):
    """Before: the rendezvous waited for the stopped rank for the collective timeout (600 s by default); a rank
    stopped in its model load left an engine that started, and failed at its first request; one stopped before
    its first heartbeat (not told from one still importing torch) was waited for the collective timeout still:
    now its process's state (stopped, in /proc) tells."""
    pid_file = tmp_path / "rank1.pid"
    rank_that(where, "stops", str(pid_file))
    with pytest.raises(EngineDeadError, match=re.escape(f"{STOPPED} {when}")):
        LLM(MODEL, **LLM_ARGS)
    failed_after = time.time() - pid_file.stat().st_mtime
    print(f"rank stopped where it {where}: the start failed {failed_after:.2f} s after the stop")
    assert failed_after < HEARTBEAT_TIMEOUT_S + MARGIN_S
    assert multiprocessing.active_children() == []  # the stopped rank was ended, not left behind


def test_a_start_that_fails_after_the_ranks_are_up_leaves_no_rank_running(monkeypatch):
    """Before: an error in rank 0's set-up after the ranks had started (its tokenizer, its sampler's seed) left rank
    1 running until the interpreter exited."""
    from kvshard.engine import llm_engine

    def broken(config):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(llm_engine, "load_tokenizer", broken)
    with pytest.raises(RuntimeError, match="the tokenizer broke"):
        LLM(MODEL, **LLM_ARGS)
    assert multiprocessing.active_children() == []


def test_a_rank_that_never_finishes_loading_fails_the_start_at_the_collective_timeout(rank_that, monkeypatch):
    """A rank alive (its heartbeat ticks) but stuck in its model load is waited for as long as the ranks wait to
    join. Before: the server started with it and failed its first request at the step timeout; then, with the
    start-up's round trip, it failed with gloo's own error, a traceback."""
    monkeypatch.setenv("KVSHARD_COLLECTIVE_TIMEOUT_S", "8")  # a rendezvous on this machine takes a second or two
    rank_that("loads", "hangs")
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="not every rank got ready, a rank loading its model being waited "
                                              "for up to KVSHARD_COLLECTIVE_TIMEOUT_S=8 s: .*[Tt]imed out"):
        LLM(MODEL, **LLM_ARGS)
    assert time.monotonic() - started < 8 + MARGIN_S
    assert multiprocessing.active_children() == []


def test_sigterm_while_serve_starts_stops_every_rank_and_says_so(rank_that, capsys, tmp_path):
    """Before: `kvshard serve` handled SIGTERM only once it served; during start-up the signal's default action
    ended rank 0 alone, without a word (status -15), leaving its ranks. Here SIGTERM's default would end the
    test, so a handler that raises stands for it: `kvshard serve` must have put its own in place."""
    import threading

    from kvshard.entrypoints.cli import main

    class Terminated(Exception):
        """What SIGTERM's default action would do: end rank 0 there and then, with no clean-up of its ranks."""

    def terminated(signum, frame):
        raise Terminated

    pid_file = tmp_path / "rank1.pid"
    rank_that("loads", "hangs", str(pid_file))

    def terminate() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, terminated)
    sender = threading.Thread(target=terminate, daemon=True)
    try:
        sender.start()
        status = main(["serve", MODEL, "-tp", "2", "--dcp", "2", "--max-model-len", "256",
                       "--kv-cache-memory", "16MiB", "--port", "0"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join()
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 130 and errors == ["kvshard: stopped while the engine started"], errors
    assert multiprocessing.active_children() == []


def test_ranks_are_spawned_with_ctrl_c_ignored():
    """A spawned rank imports torch for seconds before its first line of kvshard runs: it must already ignore
    Ctrl-C (inherited across exec), or it dies of it with a traceback. Rank 0's own handler comes back after."""
    from kvshard.engine.process_setup import rank_environment

    before = signal.getsignal(signal.SIGINT)
    with rank_environment():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before


FAILED_TO_LOAD = ("rank 1 exited with code 1 (OSError: the checkpoint's shard cannot be read) while the ranks "
                  "loaded the model")


@pytest.mark.parametrize("command, said", [("serve", f"the engine did not start: {FAILED_TO_LOAD}"),
                                           ("generate", FAILED_TO_LOAD)])
def test_the_command_line_says_in_one_line_which_rank_failed_to_load_and_why(rank_that, capsys, monkeypatch,
                                                                             command, said):
    """Before: the server started and said it was healthy, its first request failing with 'rank 1 exited with
    code 1' (and `kvshard generate` failed at its first step); a rank dying while the ranks connected was a
    traceback."""
    from kvshard.entrypoints import serve
    from kvshard.entrypoints.cli import main

    def serving(*args, **kwargs):
        raise AssertionError("the server started serving with a rank that failed")

    monkeypatch.setattr(serve, "ending_http_server", serving)
    rank_that("loads", "fails")
    flags = ["-tp", "2", "--dcp", "2", "--max-model-len", "256", "--kv-cache-memory", "16MiB"]
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        status = main([command, MODEL, *flags, *(["--port", "0"] if command == "serve" else [])])
    finally:
        signal.signal(signal.SIGTERM, sigterm)  # `kvshard serve` makes it a KeyboardInterrupt
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # the rank's exit status is its process's: 1 from its SystemExit, once 255 (a suite run on a loaded machine,
    # its teardown's); the line is what the user reads
    assert status == 1 and len(errors) == 1, errors
    assert errors[0].replace("exited with code 255", "exited with code 1") == f"kvshard: error: {said}", errors
    assert multiprocessing.active_children() == []


def _engine_whose_rank_1_hangs_loading(pid_file: str) -> None:
    """Rank 0 of an engine whose rank 1 never finishes loading its model (run in a process of its own)."""
    import rank_start

    rank_start.ranks_from_this_forkserver()
    executor.spawned_worker = RankThat(executor.spawned_worker, "loads", "hangs", pid_file)
    LLM(MODEL, **LLM_ARGS)


def test_a_rank_stops_once_rank_0_is_killed_while_it_loads(tmp_path):
    """Before: a rank whose rank 0 was killed (SIGKILL, or SIGTERM before the server had started) while it
    loaded its model or waited to connect stayed on alone, for the collective timeout or for ever."""
    pid_file = tmp_path / "rank1.pid"
    rank0 = multiprocessing.get_context("forkserver").Process(target=_engine_whose_rank_1_hangs_loading,
                                                              args=(str(pid_file),))
    rank0.start()
    rank1 = None
    try:
        rank1 = _rank_1_once_written(rank0, pid_file, 60, "rank 1 never reached its model load")
        gone_after = _kill_rank_0(rank0, rank1)
        print(f"rank 0 killed: rank 1 gone after {gone_after:.2f} s")
        assert not alive(rank1), "rank 1 outlived rank 0"
        assert gone_after < 2 * HEARTBEAT_INTERVAL_S + 2
    finally:
        _end_both(rank0, rank1)


def _rank_1_once_written(rank0, pid_file: Path, timeout_s: float, never: str) -> int:
    """Rank 1's pid, once rank 0's process has written it to `pid_file` (`never`: the failure's words)."""
    deadline = time.monotonic() + timeout_s
    while not pid_file.exists() or not pid_file.read_text():
        assert rank0.is_alive() and time.monotonic() < deadline, never
        time.sleep(0.05)
    return int(pid_file.read_text())


def _kill_rank_0(rank0, rank1: int) -> float:
    """SIGKILL rank 0's process; the seconds rank 1 outlived it (at most MARGIN_S)."""
    rank0.kill()
    rank0.join(10)
    killed = time.monotonic()
    while alive(rank1) and time.monotonic() - killed < MARGIN_S:
        time.sleep(0.05)
    return time.monotonic() - killed


def _end_both(rank0, rank1: int | None) -> None:
    if rank0.is_alive():
        rank0.kill()
        rank0.join(10)
    if rank1 is not None and alive(rank1):
        os.kill(rank1, signal.SIGKILL)


def test_ctrl_c_while_a_rank_loads_its_model_stops_every_rank_at_once(rank_that, tmp_path):
    """Ctrl-C (a SIGINT to rank 0's main thread) while rank 0 waits for a rank still loading its model. Without
    the Python loop around that wait, rank 0 waits inside gloo, where the signal is handled only when the
    collective returns (here: at the collective timeout); without ending the ranks at once, its clean-up sends
    the loading rank a shutdown it never reads, and waits for it for ever."""
    import threading

    pid_file = tmp_path / "rank1.pid"
    rank_that("loads", "hangs", str(pid_file))
    interrupted: list[float] = []
    stopped = threading.Event()

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0 has loaded its own share by now and waits for rank 1
        interrupted.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        if not stopped.wait(MARGIN_S):  # a clean-up waiting for ever (in a Python loop): a second Ctrl-C ends it
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=interrupt, daemon=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal
    try:
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            LLM(MODEL, **LLM_ARGS)
    finally:
        signal.signal(signal.SIGINT, previous)
    stopped_after = time.monotonic() - interrupted[0]
    stopped.set()
    sender.join()
    print(f"Ctrl-C while rank 1 loads: every rank stopped {stopped_after:.2f} s after it")
    assert stopped_after < 3
    assert multiprocessing.active_children() == []


def test_ctrl_c_reaching_a_rank_leaves_the_engine_serving(monkeypatch):
    """Ctrl-C in a terminal reaches every process of its group: rank 0 handles it. Before: rank 1 died of it
    (KeyboardInterrupt), so a server stopped with Ctrl-C mid-request said 'the engine died: rank 1 exited with
    code 1' and exited with status 1."""
    with LLM(MODEL, **LLM_ARGS) as llm:
        rank1 = llm.engine.executor.local_ranks.processes[1]
        os.kill(rank1.pid, signal.SIGINT)
        time.sleep(1)  # an idle rank waits in naps of at most 10 ms
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].finish_reason == "length"
        assert rank1.is_alive() and llm.engine.dead_reason is None


def test_ctrl_c_in_the_middle_of_a_step_ends_the_engine_and_close_is_prompt(monkeypatch):
    """Ctrl-C in `LLM.generate` while rank 0 runs its share of a step (which the other ranks received). Before:
    the engine went on as if alive with its ranks stuck inside that step, and close() waited 10 s for them."""
    monkeypatch.setenv("KVSHARD_STEP_TIMEOUT", "5")  # what a step of out-of-step ranks would end with
    llm = LLM(MODEL, **LLM_ARGS)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].finish_reason == "length"

        def interrupted(plan):
            raise KeyboardInterrupt

        monkeypatch.setattr(llm.engine.executor.runner, "execute", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["Hello again"], params, use_tqdm=False)
        monkeypatch.delattr(llm.engine.executor.runner, "execute")  # rank 0's share runs again
        with pytest.raises(EngineDeadError, match=r"rank 0 was interrupted \(KeyboardInterrupt\) in the middle of "
                                                  r"a step: the ranks are out of step with it"):
            llm.generate(["Hello"], params, use_tqdm=False)
    finally:
        closing = time.monotonic()
        llm.close()
        closed_after = time.monotonic() - closing
    print(f"Ctrl-C mid-step: close() took {closed_after:.2f} s")
    assert closed_after < 3
    assert multiprocessing.active_children() == []


def _async_engine():
    """An AsyncLLMEngine over a tp=2, dcp=2 engine (as the server has), and its metrics."""
    from kvshard.engine.arg_utils import EngineArgs
    from kvshard.engine.async_engine import AsyncLLMEngine
    from kvshard.engine.llm_engine import LLMEngine
    from kvshard.metrics import ServerMetrics

    config = EngineArgs.from_kwargs(MODEL, **LLM_ARGS).create_engine_config()
    metrics = ServerMetrics(config, MODEL)
    return AsyncLLMEngine(LLMEngine(config), metrics), metrics


def _samples(metrics) -> dict[tuple[str, str | None], float]:
    """{(sample name, finished_reason label or None): value}"""
    return {(sample.name, sample.labels.get("finished_reason")): sample.value
            for family in text_string_to_metric_families(metrics.render().decode()) for sample in family.samples}


def test_after_a_rank_died_mid_request_the_metrics_show_no_request_running_and_no_kv_in_use(caplog):
    """Before: /metrics kept the last step's gauges for ever (requests running, KV in use) and counted the failed
    requests nowhere."""
    caplog.set_level(logging.ERROR, logger="kvshard.engine")
    engine, metrics = _async_engine()

    async def run() -> None:
        engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
            outputs = engine.generate("doomed", [1, 2, 3, 4], params, stream=True)
            first = await outputs.__anext__()
            assert not first.finished
            os.kill(engine.engine.executor.local_ranks.processes[1].pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="rank 1 exited with code -9"):
                async for _ in outputs:
                    pass
        finally:
            engine.shutdown()  # on the loop, as the server's lifespan does; the engine loop has stopped after it

    asyncio.run(run())
    samples = _samples(metrics)
    assert samples[("kvshard:num_requests_running", None)] == 0
    assert samples[("kvshard:kv_cache_usage_perc", None)] == 0
    assert samples[("kvshard:request_success_total", "error")] == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine is dead")]
    assert said == ["engine is dead: rank 1 exited with code -9"]


def test_a_rank_lost_while_the_server_idles_is_logged(caplog):
    """Before: a rank lost while no request ran turned /health to 503 and said nothing in the log until the
    server was stopped."""
    caplog.set_level(logging.ERROR, logger="kvshard.engine")
    engine, _ = _async_engine()

    async def run() -> None:
        engine.start()
        try:
            os.kill(engine.engine.executor.local_ranks.processes[1].pid, signal.SIGKILL)
            deadline = time.monotonic() + MARGIN_S
            while engine.refusal is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert engine.refusal == "rank 1 exited with code -9"
        finally:
            engine.shutdown()  # on the loop, as the server's lifespan does

    asyncio.run(run())
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine is dead")]
    assert said == ["engine is dead: rank 1 exited with code -9"]


def test_sigterm_ends_an_open_stream_with_an_error_event_not_a_cut_connection(tmp_path):
    """Before: a stream still open when uvicorn's graceful shutdown ran out was cut mid-response (the client saw
    an incomplete chunked read) and the log got a CancelledError traceback."""
    from kvshard.entrypoints.serve import END_REQUESTS_S

    server = Server([*SERVE_ARGS[:-4], "--max-model-len", "4096", "--kv-cache-memory", "64MiB"], tmp_path / "log")
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            assert "choices" in next(events)
            server.terminate()
            stopped = time.monotonic()
            rest = list(events)
        ended_after = time.monotonic() - stopped
    finally:
        code = server.stop()
    print(f"SIGTERM with a stream open: the stream ended after {ended_after:.2f} s")
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["message"]) == ("server_shutting_down", "the server is shutting down"), error
    assert ended_after < END_REQUESTS_S + MARGIN_S
    assert code == 0, server.log
    assert "timeout graceful shutdown exceeded" not in server.log


def _engine_generating_forever(log_file: str, pid_file: str) -> None:
    """Rank 0 of a DCP engine that generates without end, its stderr (and its ranks') in `log_file`; rank 1's
    pid in `pid_file` once the engine has started (run in a process of its own)."""
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    executor.RANK_START_METHOD = "spawn"  # the rank inherits this stderr (the suite's forkserver's is its own)
    llm = LLM(MODEL, **LLM_ARGS)
    Path(pid_file).write_text(str(llm.engine.executor.local_ranks.processes[1].pid))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    while True:
        llm.generate(["tell me a story"] * 4, params, use_tqdm=False)


def test_ranks_say_in_one_line_that_rank_0_is_gone_when_it_is_killed_mid_step(tmp_path):
    """Before: every rank printed the traceback of the collective it waited in (PeerGoneError) once a serving
    rank 0 was killed: noise where the user stopped the server."""
    log_file, pid_file = tmp_path / "ranks.log", tmp_path / "rank1.pid"
    rank0 = multiprocessing.get_context("forkserver").Process(target=_engine_generating_forever,
                                                              args=(str(log_file), str(pid_file)))
    rank0.start()
    rank1 = None
    try:
        rank1 = _rank_1_once_written(rank0, pid_file, 120, "the engine never started")
        time.sleep(1.0)  # in the middle of generating
        _kill_rank_0(rank0, rank1)
        assert not alive(rank1), "rank 1 outlived rank 0"
    finally:
        _end_both(rank0, rank1)
    said = [line for line in log_file.read_text().splitlines() if line.strip() and "Warning" not in line]
    print("\n".join(said))
    assert not any("Traceback" in line for line in said), said
    assert len(said) == 1 and re.fullmatch(r"kvshard: rank 1: .*(rank 0|pid \d+).*this rank stops", said[0]), said
