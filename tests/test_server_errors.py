"""When `kvshard serve` cannot serve: bad flags stop it before any rank starts; a dead rank fails every request fast.

The refusals are raised in this process (`cli.main`, as the console script calls it) but for one, run as a
`kvshard serve` process of its own; the dead rank needs a real server."""

from __future__ import annotations

import io
import os
import shutil
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from server_harness import MODEL, ROOT, SERVE_ARGS, Server, serve_command


CORRUPT_CONFIGS = {"cut short": b'{"architectures": ["LlamaForCausalLM"], ', "not UTF-8": b"\xff\xfe",
                   "not an object": b"[1, 2]"}


@dataclass
class Refusal:
    result: subprocess.CompletedProcess
    named: str  # what the error line must name


def assert_flag_error(refusal: Refusal) -> None:
    result = refusal.result
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvshard: error:")]
    assert len(errors) == 1 and refusal.named in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert "ranks:" not in result.stdout  # the layout report comes just before the ranks start


def serve_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`kvshard serve ARGV` run in this process as its console script runs it (`sys.exit(main(argv))`), its
    output captured; reaching the server's start (which a refusal must not) raises instead of serving."""
    from kvshard.entrypoints import cli, serve

    def started(*args, **kwargs):
        raise AssertionError(f"kvshard serve {' '.join(argv)} got past its checks to the server's start")

    stdout, stderr = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout), redirect_stderr(stderr):
        patch.setattr(serve, "_serve", started)
        try:
            code = cli.main(["serve", *argv])
        except SystemExit as refused:  # argparse's own refusals
            code = refused.code
    return subprocess.CompletedProcess(argv, code, stdout.getvalue(), stderr.getvalue())


# The one refusal run as its own `kvshard serve` process (the console entry, its exit status, its output
# streams), while the others run in this process: each process is mostly Python importing on one core, and
# this one is refused before the model's config is read (which would import transformers too).
IN_A_PROCESS = "port out of range"


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, Refusal]:
    """Every refused `kvshard serve` of this module."""
    from kvshard.models.demo import ensure_demo_model

    def checkpoint_copy(name: str) -> Path:
        return Path(shutil.copytree(ensure_demo_model(MODEL), tmp_path_factory.mktemp(name) / "model"))

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = {
            "dcp not dividing tp": ([MODEL, "--tensor-parallel-size", "2", "--decode-context-parallel-size", "3"],
                                    "decode_context_parallel_size=3"),
            "port out of range": ([MODEL, "--port", "70000"], "--port 70000 is not a TCP port"),
            "port in use": ([MODEL, "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
        }
        truncated = checkpoint_copy("truncated")
        weights = truncated / "model.safetensors"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)  # an interrupted download
        cases["truncated"] = [str(truncated)], f"{weights} is truncated"
        for name, content in CORRUPT_CONFIGS.items():
            config = checkpoint_copy("config") / "config.json"
            config.write_bytes(content)
            cases[name] = [str(config.parent)], str(config)
        with ThreadPoolExecutor(1) as pool:
            alone = pool.submit(subprocess.run, serve_command(*cases[IN_A_PROCESS][0]), cwd=ROOT, capture_output=True,
                                text=True, timeout=300)
            results = {name: serve_in_process(argv) for name, (argv, _) in cases.items() if name != IN_A_PROCESS}
            results[IN_A_PROCESS] = alone.result()
    return {name: Refusal(results[name], named) for name, (_, named) in cases.items()}


@pytest.mark.parametrize("case", ["dcp not dividing tp", "port out of range"])
def test_bad_flags_print_one_line_and_exit_2(refusals, case):
    assert_flag_error(refusals[case])


def test_port_in_use_is_a_flag_error(refusals):
    assert_flag_error(refusals["port in use"])


def test_truncated_checkpoint_is_one_line_naming_the_file_and_exit_2(refusals):
    assert_flag_error(refusals["truncated"])


@pytest.mark.parametrize("case", list(CORRUPT_CONFIGS))
def test_corrupt_config_is_one_line_naming_the_file_and_exit_2(refusals, case):
    assert_flag_error(refusals[case])


@pytest.fixture
def doomed_server(tmp_path):
    # one running request at a time, so a second one waits in the queue; requests long enough
    # (4,000 tokens, tens of seconds) to be still running when the rank is killed
    server = Server([*SERVE_ARGS, "--max-num-seqs", "1", "--max-model-len", "4096"], tmp_path / "log")
    yield server
    server.stop()


def test_killed_rank_fails_running_waiting_and_new_requests_within_10_seconds(doomed_server):
    server = doomed_server
    client = server.client(timeout=30)

    def long_stream():
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=4000, stream=True,
                                         extra_body={"ignore_eos": True})

    running = long_stream()
    next(iter(running))
    waiting = long_stream()
    assert server.wait_for_metric("kvshard:num_requests_waiting", lambda v: v == 1) == 1
    (rank1,) = server.rank_pids()

    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    for stream in (running, waiting):
        with pytest.raises(openai.APIError, match="rank 1 exited"):
            for _ in stream:
                pass
    streams_failed_after = time.monotonic() - killed_at

    health = server.http.get("/health")
    assert health.status_code == 503 and "rank 1 exited with code -9" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError, match="rank 1 exited") as refused:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert refused.value.status_code == 503
    detected_after = time.monotonic() - killed_at
    print(f"dead rank: open streams failed after {streams_failed_after:.2f}s, "
          f"/health and new requests answered 503 after {detected_after:.2f}s")
    assert detected_after < 10

    assert server.stop() == 1
    assert "the engine died: rank 1 exited with code -9" in server.log
